"""The GPU validation script (benchmarks/gpu/) on the CPU: its dry run passes, and each of
its checks fails when what it checks is broken. Also the ``cuda`` marker's rules
(tests/conftest.py): skipped without a GPU, a skip with one is a failure."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tw_triton
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
import _precompile  # noqa: E402
import _smoke  # noqa: E402
import validate  # noqa: E402
from _gpu_pytest import HUGE, HUGE_HOME  # noqa: E402


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
    assert result["device"]["kernel"] == platform.release() and result["device"]["crc32"] in ("isal", "zlib")
    steps = result["steps"]
    assert list(steps) == list(validate.ONE_CALL[0])
    assert all(s["status"] == "PASS" for s in steps.values())
    ident = steps["identity"]["data"]
    assert set(ident["codecs"]) >= {"blockwise", "log2"} and "exact" in ident["codecs_without_kernel"]
    assert ident["cases_run"] == ident["cases_planned"] > 50
    assert steps["pytest"]["data"]["collected"] > 0
    assert steps["concurrency"]["data"]["runs"][1]["device_branch_forced"] is True
    summary = (out / "summary.md").read_text()
    assert "Dry run on the CPU" in summary and "| **PASS** |" in summary
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [r["name"] for r in rows] == list(steps)
    grid = _precompile.default_grid()  # three inputs an entry, and the weight deltas' qmax widths
    assert steps["identity_grid"]["data"]["cases_run"] == len(_identity.plan_grid(grid)) > 3 * len(grid)
    assert steps["save_load"]["data"]["tensors_compared"] > 0
    # Issue 29, item 7: save() is also timed as a loop calls it, right after a step.
    saves = steps["end_to_end"]["data"]["save"]
    assert all(saves[m]["blocked_in_loop_s"] > 0 for m in ("tw keyframe", "tw delta"))
    assert "right after a step" in summary
    assert "tw_triton, by cumulative time:" in summary
    assert "The same load's phases in every thread" in summary
    # Elements a second beside the bandwidth: equal across dtypes where a kernel is compute-bound.
    timed = steps["throughput"]["data"]["rows"]
    assert timed and all(r["g_elements_per_s"] > 0 for r in timed)
    assert "| GB/s | G elements/s | copy GB/s |" in summary


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
    # The same validation run phase by phase: one device block with every phase's steps.
    (root / "test-device-1" / "results.json").unlink()
    names = list(data["steps"])
    for phase, part in (("end-to-end", names[len(names) // 2 :]), ("smoke", names[: len(names) // 2])):
        one = dict(data, steps={k: data["steps"][k] for k in part})
        (root / "test-device-1" / f"results-{phase}.json").write_text(json.dumps(one))
    phased = make_results.gpu_section(root)
    assert phased.count("### Test Device 1") == 1 and "summary-smoke.md" in phased
    assert all(data["steps"][k]["title"] in phased for k in names)
    assert phased.index(data["steps"][names[0]]["title"]) < phased.index(data["steps"][names[-1]]["title"])


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


def test_the_smoke_load_check_expects_the_steps_on_the_host(tmp_path):
    """A load to the GPU decodes the optimizer's 0-dim ``step`` tensors (and numpy leaves)
    on the host (state/decode.py host_leaf_paths): the smoke step must not count them as
    misplaced. Here the "device" is ``meta``: every other leaf is moved there, as a load to
    CUDA puts it on CUDA. The smoke's first check (every leaf on the device) flagged the
    steps of a real AdamW state, so the step would have failed on every GPU."""
    model, opt, _ = _end_to_end.build(torch.device("cpu"), "tiny")
    with tw_triton.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, model=model, optimizer=opt).result()
        loaded = tw_triton.tree.flatten(ck.load(1))[0]
        on_host = _smoke.host_paths(ck.path_for(1))
    steps = {n for n in loaded if n.startswith("optimizer/state/") and n.endswith("/step")}
    assert steps and steps <= on_host
    on_device = {n: t if n in on_host else t.to("meta") for n, t in loaded.items()}
    meta = torch.device("meta")
    assert _smoke.misplaced(on_device, meta, on_host) == []
    assert steps <= {n for n, t in on_device.items() if t.device.type != "meta"}  # the first check's flags
    on_device[sorted(steps)[0]] = on_device[sorted(steps)[0]].to("meta")
    assert _smoke.misplaced(on_device, meta, on_host) == [f"{sorted(steps)[0]}: loaded on meta, not cpu"]
    first = next(n for n in loaded if n not in on_host)
    on_device[first] = loaded[first]
    assert f"{first}: loaded on cpu, not meta" in _smoke.misplaced(on_device, meta, on_host)


def test_the_smoke_grid_matches_the_cpu_on_the_kernels():
    """The smoke step's cases (every codec of the default grid) with the device side on the
    kernels: without a GPU, the Triton backend's kernels interpreted on CPU tensors."""
    from _kernel_testing import KERNEL_DEVICE, require_runnable_kernels

    require_runnable_kernels()
    side = _identity.kernels_on_cpu if KERNEL_DEVICE.type == "cpu" else contextlib.nullcontext
    cases = _identity.plan_grid(_precompile.default_grid())
    report = _identity.run_identity(KERNEL_DEVICE, dry_run=False, budget_s=1e9, cases=cases, device_side=side)
    assert report.failures == [] and report.run == report.planned == len(cases)
    assert {c.codec for c in cases} == set(_identity.kernel_codecs()[0]) - {"bitmask"}


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
    # The device branch keeps a state's own tensors in its exact entries and copies what the
    # writer would read late (host tensors, the keyframe's reference) in save(): skip that.
    monkeypatch.setattr(tw_triton.save_pipeline, "private_copies", lambda flat, *a, **k: flat)
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


def _run_marker_suite(tmp_path: Path, assume_cuda: bool, devices: int = 1) -> subprocess.CompletedProcess:
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_marked.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.cuda\n"
        "def test_needs_gpu():\n"
        "    pytest.skip('pretend the device is missing')\n\n"
        "@pytest.mark.cuda(devices=2)\n"
        "def test_needs_two_gpus():\n"
        "    assert True\n\n"
        "def test_plain():\n"
        "    assert True\n",
        encoding="utf-8",
    )
    env = _env()
    env.pop("TW_TRITON_TEST_ASSUME_CUDA", None)
    env["TW_TRITON_TEST_ASSUME_CUDA_DEVICES"] = str(devices)
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
    assert "1 passed, 2 skipped" in without.stdout
    # One GPU: the test of two is skipped, not failed, and says why.
    with_gpu = _run_marker_suite(tmp_path, assume_cuda=True)
    assert with_gpu.returncode == 1, with_gpu.stdout
    assert "1 failed, 1 passed, 1 skipped" in with_gpu.stdout
    assert "skipped although a CUDA device is present" in with_gpu.stdout
    reasons = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env={**_env(), "TW_TRITON_TEST_ASSUME_CUDA": "1", "TW_TRITON_TEST_ASSUME_CUDA_DEVICES": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert validate.NEEDS_DEVICES.search(reasons), reasons
    # Two GPUs: it runs.
    with_two = _run_marker_suite(tmp_path, assume_cuda=True, devices=2)
    assert "1 failed, 2 passed" in with_two.stdout, with_two.stdout


# ------------------------------------------------------------------ issue 29: install, phases, grid


def _tiny_wheel(tmp_path: Path) -> Path:
    """A folder holding one wheel, built here from a tiny local package ``tw_tiny_wheel``."""
    src = tmp_path / "src"
    (src / "tw_tiny_wheel").mkdir(parents=True)
    (src / "tw_tiny_wheel" / "__init__.py").write_text("VALUE = 29\n")
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "tw-tiny-wheel"\nversion = "0.1"\n'
    )
    wheels = tmp_path / "whl"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation"]
        + ["-w", str(wheels), str(src)],
        check=True,
        timeout=120,
    )
    assert [p.suffix for p in wheels.iterdir()] == [".whl"]
    return wheels


def test_install_step_installs_a_wheel_folder_offline_into_a_target(tmp_path):
    """install.sh's wheel step, as validate.sh runs it on the GPU machine, with pip
    --no-index --no-deps: a wheel built here from a tiny local package lands in the target
    and imports from there; a module nothing provides is named as missing."""
    wheels = _tiny_wheel(tmp_path)
    env = dict(_env(), PYTHON=sys.executable, INSTALL_CHECK="tw_tiny_wheel", PIP_NO_INDEX="1")
    target = tmp_path / "site"
    cmd = [
        "bash",
        str(GPU_DIR / "install.sh"),
        "--wheels",
        str(wheels),
        "--target",
        str(target),
        "--no-project",
    ]
    ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "installing 1 wheel(s)" in ok.stderr and "ok (tw_tiny_wheel import)" in ok.stderr
    assert ok.stdout == f"{target.resolve()}\n"  # what the caller puts on PYTHONPATH
    probe = "import tw_tiny_wheel as m; print(m.VALUE, m.__file__)"
    got = subprocess.run(
        [sys.executable, "-c", probe], env=dict(env, PYTHONPATH=str(target)), capture_output=True, text=True
    )
    assert got.stdout.split()[0] == "29" and got.stdout.split()[1].startswith(str(target)), got.stderr
    env["INSTALL_CHECK"] = "tw_tiny_wheel tw_not_in_any_wheel"
    bad = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 4 and "MISSING after the offline install: tw_not_in_any_wheel" in bad.stderr


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_install_step_falls_back_to_a_folder_and_the_checkout_in_place(tmp_path):
    """Where the environment's site-packages takes no install (forced here: as root it
    cannot be made read-only), ``--fallback DIR`` puts the wheels in DIR and uses the
    checkout in place: its C extension built beside its sources, ``tw_triton/kernels`` a
    link to ``kernels/`` (the install's package-dir mapping), and both folders printed for
    PYTHONPATH. A second run finds DIR and does it again (on a warm GPU machine the tree is
    sent again, maybe changed). Run on a copy of the script inside a tiny checkout of its
    own (a stand-in ``tw_triton``), so that nothing here is built or installed."""
    wheels = _tiny_wheel(tmp_path)
    repo = tmp_path / "repo"
    (repo / "benchmarks" / "gpu").mkdir(parents=True)
    shutil.copy(GPU_DIR / "install.sh", repo / "benchmarks" / "gpu" / "install.sh")
    (repo / "tw_triton").mkdir()
    (repo / "tw_triton" / "__init__.py").write_text("TINY = True\n")
    (repo / "tw_triton" / "ext.c").write_text(
        "#include <Python.h>\n"
        'static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "_ext", NULL, -1, NULL};\n'
        "PyMODINIT_FUNC PyInit__ext(void) { return PyModule_Create(&m); }\n"
    )
    (repo / "kernels").mkdir()
    (repo / "kernels" / "__init__.py").write_text("VALUE = 1\n")
    (repo / "setup.py").write_text(
        "from setuptools import Extension, setup\n"
        "setup(ext_modules=[Extension('tw_triton._ext', ['tw_triton/ext.c'], optional=True)])\n"
    )
    site = tmp_path / "site"
    env = dict(
        _env(),
        PYTHON=sys.executable,
        INSTALL_CHECK="tw_tiny_wheel",
        PIP_NO_INDEX="1",
        TW_GPU_READONLY_SITE="1",
    )
    cmd = [
        "bash",
        str(repo / "benchmarks" / "gpu" / "install.sh"),
        "--wheels",
        str(wheels),
        "--fallback",
        str(site),
    ]
    probe = (
        "import tw_triton, tw_triton.kernels as k, tw_triton._ext as e, tw_tiny_wheel as w; "
        "print(tw_triton.TINY, k.VALUE, e.__file__, w.__file__)"
    )

    def imported(stdout: str) -> list[str]:
        got = subprocess.run(
            [sys.executable, "-c", probe],
            env=dict(env, PYTHONPATH=stdout.strip()),
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        return got.stdout.split() or [got.stderr]

    ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "takes no install: wheels to" in ok.stderr and "ok (tw_tiny_wheel import)" in ok.stderr
    assert ok.stdout == f"{site.resolve()}:{repo.resolve()}\n"
    tiny, value, ext_file, wheel_file = imported(ok.stdout)
    assert (tiny, value) == ("True", "1")
    assert ext_file.startswith(str(repo / "tw_triton")) and wheel_file.startswith(str(site.resolve()))
    assert (repo / "tw_triton" / "kernels").is_symlink()
    (repo / "kernels" / "__init__.py").write_text("VALUE = 2\n")
    del env["TW_GPU_READONLY_SITE"]  # the folder alone says the environment took none before
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "holds an earlier run's install: replacing it" in again.stderr and again.stdout == ok.stdout
    assert imported(again.stdout)[1] == "2"


def test_wheel_script_and_validate_sh_never_reach_the_network():
    wheels = (REPO / "tools" / "gpu_wheels.sh").read_text()
    assert "--only-binary=:all:" in wheels and "--python-version 3.12" in wheels and "--no-deps" in wheels
    assert "--platform manylinux2014_x86_64" in wheels and '"zstandard==' in wheels and '"isal==' in wheels
    install = (GPU_DIR / "install.sh").read_text()
    assert "pip install --quiet --no-index --no-deps" in install and "--no-build-isolation -e ." in install
    sh = (GPU_DIR / "validate.sh").read_text()
    assert "pip install" not in sh and "install.sh" in sh
    # validate.sh puts what install.sh prints on PYTHONPATH (its fallback folders).
    assert '$(bash benchmarks/gpu/install.sh --fallback "$site")' in sh and 'PYTHONPATH="$paths' in sh
    assert ".whl/" in (REPO / ".gitignore").read_text()


def _bin_of(tmp_path: Path, tools: tuple[str, ...]) -> Path:
    """A folder holding links to ``tools`` alone, to be the whole ``PATH``."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in tools:
        found = shutil.which(tool)
        assert found is not None
        (bindir / tool).symlink_to(found)
    return bindir


def _smoke_in(bindir: Path, python: str, home: Path) -> subprocess.CompletedProcess:
    """``validate.sh --phase smoke`` with ``bindir`` the whole ``PATH``."""
    env = {"PATH": str(bindir), "PYTHON": python, "HOME": str(home)}
    return subprocess.run(
        [str(bindir / "bash"), str(GPU_DIR / "validate.sh"), "--phase", "smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_validate_sh_stops_at_once_without_a_c_compiler(tmp_path):
    """Triton builds its launcher with a C compiler at the first launch: validate.sh checks
    for one before installing or running anything."""
    bindir = _bin_of(tmp_path, ("bash", "dirname", "env"))  # what the script needs before the check
    got = _smoke_in(bindir, sys.executable, tmp_path)
    assert got.returncode == 2 and "no C compiler" in got.stderr, got.stderr


def test_validate_sh_hands_a_plain_cc_to_triton(tmp_path):
    """Triton's launcher build takes $CC, else gcc, else clang (triton/runtime/build.py),
    never ``cc``: where ``cc`` is the only compiler, validate.sh exports it as $CC."""
    bindir = _bin_of(tmp_path, ("bash", "dirname"))
    seen = tmp_path / "seen"
    # A python that records the CC it runs with, and passes (saying tw_triton.kernels is
    # this checkout's, when asked where it lives).
    for tool, says in (("cc", ""), ("python", f"echo {REPO}\n")):
        (bindir / tool).write_text(f'#!/bin/sh\necho "CC=${{CC:-}}" >> {seen}\n{says}exit 0\n')
        (bindir / tool).chmod(0o755)
    got = _smoke_in(bindir, str(bindir / "python"), tmp_path)
    assert got.returncode == 0, got.stderr
    assert seen.read_text().splitlines()[-1] == f"CC={bindir / 'cc'}", seen.read_text()


def test_phases_split_every_step_in_three_and_fit_their_limits():
    all_steps = [n for steps, _ in validate.PHASES.values() for n in steps]
    assert sorted(all_steps) == sorted(validate.RUNNERS) and len(set(all_steps)) == len(all_steps)
    assert list(validate.PHASES) == ["smoke", "kernels", "end-to-end"]
    assert validate.PHASES["smoke"][1] <= 180 and all(b < 480 for _, b in validate.PHASES.values())
    for steps, budget in validate.PHASES.values():
        assert sum(validate.BUDGETS[n] for n in steps) <= budget, steps
    for alias, phase in (("1", "smoke"), ("2", "kernels"), ("3", "end-to-end")):
        assert validate.PHASE_ALIASES[alias] == phase
    assert validate.plan_phase("smoke", None) == (["precompile", "identity_grid", "save_load"], 170.0)
    # The default is one command of every step, the smoke phase's first.
    one, budget = validate.plan_phase("all", None)
    assert sorted(one) == sorted(all_steps) and len(set(one)) == len(one)
    assert one[:3] == list(validate.PHASES["smoke"][0]) and budget == validate.ONE_CALL[1]


def test_one_call_fits_a_15_minute_lease_with_a_rerun():
    """About 2 minutes to start a machine, the one command (its budget, the install and
    the interpreter's start, 60 s), and a second start with a smoke phase must fit 900 s."""
    start, overhead = 120.0, 60.0
    one_call = start + validate.ONE_CALL[1] + overhead
    rerun = start + validate.PHASES["smoke"][1] + overhead
    assert one_call + rerun <= 900.0
    # What cannot stop itself fits on its own; the rest start with at least their minimum.
    fixed = [n for n in validate.ONE_CALL[0] if n not in validate.SELF_STOPPING]
    assert sum(validate.BUDGETS[n] for n in fixed) < validate.ONE_CALL[1]
    assert all(validate.SELF_STOPPING[n] <= validate.BUDGETS[n] for n in validate.SELF_STOPPING)


def test_a_step_that_stops_itself_starts_with_what_is_left():
    assert validate.step_budget("identity", 1000.0) == validate.BUDGETS["identity"]
    assert validate.step_budget("identity", 30.0) == 30.0
    assert validate.step_budget("identity", 19.0) is None  # under its minimum of 20 s
    assert validate.step_budget("identity", 50.0, scale=2.0) == 50.0  # minimum 40 s
    assert validate.step_budget("identity", 39.0, scale=2.0) is None
    # save_load cannot stop midway: it starts only with its whole budget.
    assert validate.step_budget("save_load", validate.BUDGETS["save_load"]) == validate.BUDGETS["save_load"]
    assert validate.step_budget("save_load", validate.BUDGETS["save_load"] - 1) is None


def _run_validate(args: list[str], env_extra: dict[str, str], code: str | None = None):
    env = dict(_env(), **env_extra)
    cmd = [sys.executable, str(GPU_DIR / "validate.py"), *args]
    if code is not None:  # run main() after ``code`` (e.g. a runner replaced)
        prog = f"import sys; sys.path.insert(0, {str(GPU_DIR)!r}); import os, validate\n{code}\n"
        prog += f"sys.exit(validate.main({args!r}))"
        cmd = [sys.executable, "-c", prog]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_smoke_phase_goes_to_out_and_writes_only_its_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = _run_validate(["--phase", "1", "--dry-run"], {"OUT": str(out)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "VALIDATION smoke PASSED" in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "results-smoke.json",
        "steps-smoke.jsonl",
        "summary-smoke.md",
    ]
    result = json.loads((out / "results-smoke.json").read_text())
    assert result["phase"] == "smoke" and list(result["steps"]) == [
        "precompile",
        "identity_grid",
        "save_load",
    ]
    assert result["steps"]["precompile"]["data"]["grid"] == [e.label() for e in _precompile.default_grid()]


def test_a_run_killed_midway_leaves_the_finished_rows_and_the_plan(tmp_path):
    """The table is written before the first step, and each finished step's row is on the
    disk before the next starts: a process that dies in step 2 returns step 1's result,
    and the table names the step it died in (RUNNING)."""
    out = tmp_path / "partial"
    code = "validate.RUNNERS['identity_grid'] = lambda c: os._exit(7)"
    proc = _run_validate(["--phase", "smoke", "--dry-run", "--out", str(out)], {}, code)
    assert proc.returncode == 7, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "steps-smoke.jsonl").read_text().splitlines()]
    assert [(r["name"], r["status"]) for r in rows] == [("precompile", "PASS")]
    result = json.loads((out / "results-smoke.json").read_text())
    status = {n: s["status"] for n, s in result["steps"].items()}
    assert status == {"precompile": "PASS", "identity_grid": "RUNNING", "save_load": "PENDING"}
    assert result["passed"] is False
    detail = result["steps"]["identity_grid"]["detail"]
    assert re.match(r"started \d+ s into the run with a budget of 50 s", detail), detail
    summary = (out / "summary-smoke.md").read_text()
    assert "Overall: **RUNNING**" in summary and summary.count("| **PENDING** |") == 1
    assert summary.count("| **RUNNING** |") == 1
    assert not list(out.glob("*.tmp"))


def test_a_step_that_raises_fails_and_the_phase_goes_on(tmp_path):
    out = tmp_path / "raised"
    code = "def boom(c):\n    raise RuntimeError('injected')\nvalidate.RUNNERS['identity_grid'] = boom"
    proc = _run_validate(["--phase", "smoke", "--dry-run", "--out", str(out)], {}, code)
    assert proc.returncode == 1
    steps = json.loads((out / "results-smoke.json").read_text())["steps"]
    assert steps["identity_grid"]["status"] == "FAIL" and "injected" in steps["identity_grid"]["detail"]
    assert steps["save_load"]["status"] == "PASS"


def test_a_device_error_restarts_the_process_for_the_steps_left(tmp_path):
    """A CUDA error (an illegal address, say) poisons the process's context, so every later
    step would fail on it: the run goes on in a fresh process (exec) with the steps left,
    appending to the same results. Here the device check reports an error after the step
    that raises; the fresh process (no injected code) runs save_load and passes it."""
    out = tmp_path / "restarted"
    code = (
        "def boom(c):\n    raise RuntimeError('CUDA error: an illegal memory access was encountered')\n"
        "validate.RUNNERS['identity_grid'] = boom\n"
        "calls = []\n"  # the check after the second step (identity_grid) finds the error
        "def broken(d):\n    calls.append(d)\n    return 'AcceleratorError: injected' if len(calls) == 2 else None\n"
        "validate.device_error = broken\n"
    )
    proc = _run_validate(["--phase", "smoke", "--dry-run", "--out", str(out)], {}, code)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        "the device failed after identity_grid (AcceleratorError: injected): a new process runs save_load"
        in proc.stderr
    )
    rows = [json.loads(line) for line in (out / "steps-smoke.jsonl").read_text().splitlines()]
    assert [(r["name"], r["status"]) for r in rows] == [
        ("precompile", "PASS"),
        ("identity_grid", "FAIL"),
        ("save_load", "PASS"),
    ]
    assert rows[1]["data"]["device_error_after"] == "AcceleratorError: injected"
    result = json.loads((out / "results-smoke.json").read_text())
    assert {n: s["status"] for n, s in result["steps"].items()} == {
        "precompile": "PASS",
        "identity_grid": "FAIL",
        "save_load": "PASS",
    }
    assert result["passed"] is False and "VALIDATION smoke FAILED: identity_grid" in proc.stdout


def test_triton_is_pointed_at_the_libcuda_torch_loaded_when_its_lookup_fails(tmp_path, monkeypatch):
    """Triton links its launcher against libcuda.so.1, found through ``/sbin/ldconfig -p``;
    where that finds nothing every launch fails, though torch loaded it: the run sets
    TRITON_LIBCUDA_PATH to torch's directory. Faked: the lookup, CUDA's init, the maps."""
    import triton.backends.nvidia.driver as nvidia

    lib = tmp_path / "nvidia" / "lib64"
    lib.mkdir(parents=True)
    (lib / "libcuda.so.1").write_bytes(b"")
    (lib / "libcuda.so.550.54").write_bytes(b"")
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
        f"7f02-7f03 r-xp 00000000 08:01 2 {lib / 'libcuda.so.550.54'}\n"
    )
    monkeypatch.setattr(validate.torch.cuda, "init", lambda: None)
    monkeypatch.delenv("TRITON_LIBCUDA_PATH", raising=False)
    monkeypatch.setattr(nvidia, "libcuda_dirs", lambda: ["/usr/lib/x86_64-linux-gnu"])
    assert validate.libcuda_for_triton(str(maps)) is None and "TRITON_LIBCUDA_PATH" not in os.environ

    def not_found():
        raise FileNotFoundError("[Errno 2] No such file or directory: '/sbin/ldconfig'")

    monkeypatch.setattr(nvidia, "libcuda_dirs", not_found)
    assert validate.libcuda_for_triton(str(maps)) == str(lib)
    assert os.environ["TRITON_LIBCUDA_PATH"] == str(lib)
    assert nvidia.knobs.nvidia.libcuda_path == str(lib)  # what Triton's own lookup reads first
    assert validate.libcuda_for_triton(str(maps)) is None  # set already: left alone
    monkeypatch.delenv("TRITON_LIBCUDA_PATH")
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    assert validate.libcuda_for_triton(str(maps)) is None and "TRITON_LIBCUDA_PATH" not in os.environ


def test_the_run_budget_trims_or_skips_steps(tmp_path, monkeypatch):
    """On a fake clock: each fake step advances it by its cost and records the budget it
    was given. identity_grid (stops itself) gets what is left; save_load, which cannot stop,
    is skipped when its 40 s do not fit."""
    now = [0.0]
    ran: dict[str, float] = {}
    cost = {"precompile": 30.0, "identity_grid": 45.0, "save_load": 1.0}

    def fake(name):
        def run(c):
            ran[name] = c.budget
            now[0] += cost[name]
            return validate.Step(name, name, "PASS")

        return run

    monkeypatch.setattr(validate, "_clock", lambda: now[0])
    for name in validate.PHASES["smoke"][0]:
        monkeypatch.setitem(validate.RUNNERS, name, fake(name))
    rc = validate.main(["--phase", "smoke", "--dry-run", "--out", str(tmp_path), "--phase-budget", "100"])
    # precompile: 60 s of 100; identity_grid: min(50, 70) = 50; save_load: 25 s left < 40.
    assert rc == 1 and ran == {"precompile": 60.0, "identity_grid": 50.0}
    steps = json.loads((tmp_path / "results-smoke.json").read_text())["steps"]
    assert [s["status"] for s in steps.values()] == ["PASS", "PASS", "SKIPPED"]
    assert steps["save_load"]["detail"] == "run budget: 25 of 100 s left, the step needs 40 s"
    assert steps["identity_grid"]["seconds"] == 45.0
    assert "**SKIPPED**" in (tmp_path / "summary-smoke.md").read_text()

    now[0], ran = 0.0, {}
    cost["precompile"] = 95.0  # 5 s left: under identity_grid's minimum of 10 s
    rc = validate.main(["--phase", "smoke", "--dry-run", "--out", str(tmp_path), "--phase-budget", "100"])
    assert rc == 1 and ran == {"precompile": 60.0}
    steps = json.loads((tmp_path / "results-smoke.json").read_text())["steps"]
    assert steps["identity_grid"]["detail"] == "run budget: 5 of 100 s left, the step needs 10 s"


def test_end_to_end_starts_no_round_past_its_budget(tmp_path):
    """The warm-up and one timed round always run; with no time left, no more."""
    r = _end_to_end.run_save_load(torch.device("cpu"), tmp_path / "a", size="tiny", rounds=3, budget_s=0.0)
    assert (r["rounds"], r["rounds_planned"]) == (1, 3)
    assert "past the step's budget" in r["keyframe_load_by_threads"]["skipped"]  # no time left for it
    assert "by reading threads was skipped" in validate.end_to_end_table(r)
    assert r["save"]["tw delta"]["file_bytes"] > 0 and r["save"]["dcp.async_save"]["file_bytes"] > 0
    lines: list[str] = []
    r = _end_to_end.run_save_load(
        torch.device("cpu"), tmp_path / "b", size="tiny", rounds=2, budget_s=None, log=lines.append
    )
    assert (r["rounds"], r["rounds_planned"]) == (2, 2)
    # Each round's timings reach the console as it ends: a command killed in a later round
    # (the step's results are written when it ends) keeps them in console.log.
    rounds = [line for line in lines if line.startswith("end-to-end round ")]
    assert [line.split(" in ")[0] for line in rounds] == [
        "end-to-end round 0 (warm-up)",
        "end-to-end round 1",
        "end-to-end round 2",
    ]
    assert all(f"{m} " in rounds[-1] for m in _end_to_end.SAVE_METHODS + ("load torch.load",))
    # Where a load's time goes: the library's phases by cumulative time (the own times of
    # the loading thread show mostly its waits on the reading threads).
    # tw delta: the first delta after the keyframe, one link; tw chain: the newest, its chain
    # a link longer each round (rounds 1 and 2: 2 and 3 links).
    assert r["load"]["tw chain"]["links"] == 2.5 and "per_link_s" in r["load"]["tw chain"]
    phases = [row["function"] for row in r["load_profile"]["tw delta"]["top_cumulative"]]
    assert any(f.startswith("checkpointer.py:") and f.endswith(":load") for f in phases), phases
    # ...and in every thread: a delta's load reads two files (the keyframe only where the
    # delta codes), decodes each, and checks every buffer it reads.
    timed = r["load_profile"]["tw delta"]["phases"]
    assert timed["read the files"]["calls"] == 2 and timed["rebuild the tree"]["calls"] == 1
    assert timed["decode the entries"]["calls"] == 2
    assert timed["read: CRC-32"]["calls"] >= timed["read: one buffer"]["calls"] > 0
    assert timed["read: a compressed buffer to the device"]["calls"] == 0  # the CPU: no upload
    sweep = r["keyframe_load_by_threads"]
    assert list(sweep["seconds"]) == [str(c) for c in _end_to_end.sweep_counts()]
    assert all(secs > 0 for secs in sweep["seconds"].values())
    assert "| reading threads | load to the device (s) |" in validate.end_to_end_table(r)


def test_the_thread_sweep_runs_each_count_and_puts_the_variable_back(monkeypatch):
    from tw_triton.parallel import ENV_THREADS, cpu_threads

    assert _end_to_end.sweep_counts(16) == [4, 8, 16]
    assert _end_to_end.sweep_counts(12) == [4, 8, 12]
    assert _end_to_end.sweep_counts(64) == [4, 8, 16, 32]
    assert _end_to_end.sweep_counts(2) == [2]
    for before in (None, "3"):
        if before is None:
            monkeypatch.delenv(ENV_THREADS, raising=False)
        else:
            monkeypatch.setenv(ENV_THREADS, before)
        seen: list[int] = []
        sweep = _end_to_end.sweep_threads(lambda: seen.append(cpu_threads()), counts=[2, 5], repeats=2)
        assert seen == [2, 2, 5, 5] and list(sweep["seconds"]) == ["2", "5"]
        assert os.environ.get(ENV_THREADS) == before
        assert sweep["default_threads"] == cpu_threads()


def test_phase_timers_time_every_thread_and_put_the_functions_back(monkeypatch):
    from tw_triton.format import buffer_io, checksum, reader

    # A lazy module (transformers' kind) whose __getattr__ imports what is not installed:
    # looking for the timed functions must not call it.
    lazy = types.ModuleType("tw_lazy_module")

    def _missing(name: str):
        raise ModuleNotFoundError(f"tw_lazy_module.{name} needs a package that is not installed")

    lazy.__getattr__ = _missing  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "tw_lazy_module", lazy)

    crc32, read_file = checksum.crc32, reader.read_file
    with _end_to_end.phase_timers() as phases:
        assert checksum.crc32 is not crc32 and reader.read_file is not read_file
        assert buffer_io.crc32 is checksum.crc32  # where the reads call it, by name
        results: list[int] = []
        alive = threading.Barrier(3)  # the three at once: no thread id reused

        def work(start: int) -> None:
            alive.wait()
            results.append(checksum.crc32(b"ab", start))

        threads = [threading.Thread(target=work, args=(start,)) for start in (0, 0, 7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results.append(checksum.crc32(b"ab"))
    assert checksum.crc32 is crc32 and buffer_io.crc32 is crc32 and reader.read_file is read_file
    assert sorted(results) == sorted([crc32(b"ab")] * 3 + [crc32(b"ab", 7)])
    assert phases["read: CRC-32"]["calls"] == 4 and phases["read: CRC-32"]["threads"] == 4
    assert phases["read the files"] == {"calls": 0, "seconds": 0.0, "threads": 0}


def test_the_grid_is_what_the_presets_code_with_a_kernel():
    """Derived from tw_triton.rules, not listed: every preset's rule whose codec runs
    kernels (has one, or is coded with a partner) is in it on every dtype (with a reference
    when the rule codes deltas), and it holds nothing else. The hand list below is only a
    cross-check of today's presets."""
    from tw_triton.rules import PRESETS

    assert _precompile.default_bits_block() == (8, 128)
    grid = _precompile.default_grid()
    assert len(set(grid)) == len(grid)
    rules = _precompile.preset_rules()
    assert set(rules) == set(PRESETS)
    derived = set()
    for preset_rules in rules.values():
        for r in preset_rules:
            codec = get_codec(r.codec)
            if not (codec.has_kernel or codec.has_partners):
                continue
            kparams = tuple(sorted((k, v) for k, v in r.params.items() if k != "delta"))
            for dtype in _precompile.DTYPES:
                if not codec.accepts(torch.empty(1, dtype=getattr(torch, dtype))):
                    continue
                derived.add(_precompile.Entry(r.codec, kparams, dtype, False))
                if codec.uses_reference(r.params):
                    derived.add(_precompile.Entry(r.codec, kparams, dtype, True))
    assert set(grid) == derived
    today = {(e.codec, e.bits, e.block, e.has_ref) for e in grid}
    assert today == {("blockwise", b, 128, ref) for b in (8, 4, 2) for ref in (False, True)} | {
        ("log2", b, 128, False) for b in (8, 4)
    } | {("log2-temporal", 4, 128, ref) for ref in (False, True)} | {("blockwise-update", 4, 128, False)}
    assert {e.dtype for e in grid if e.codec == "log2-temporal"} == {"float32"}
    cases = _identity.plan_grid(grid)
    assert {(c.codec, c.bits, c.block, c.dtype, c.ref_dtype is not None) for c in cases} == {
        (e.codec, e.bits, e.block, getattr(torch, e.dtype), e.has_ref) for e in grid
    }
    assert {c.variant for c in cases} == {"finite", "adversarial", "nonneg"}
    # The weight deltas' max_error choice: fewer levels in the 4- and 8-bit containers,
    # alone and in a group whose members each have their own.
    assert _identity.ladder_qmax(4) == [2, 3, 6] and _identity.ladder_qmax(8) == [8, 15, 31, 63, 100, 126]
    assert _identity.ladder_qmax(2) == []
    laddered = {(c.bits, dict(c.extra)["qmax"], c.dtype) for c in cases if c.codec == "blockwise" and c.extra}
    assert laddered == {
        (b, q, getattr(torch, d))
        for b in (4, 8)
        for q in _identity.ladder_qmax(b)
        for d in _precompile.DTYPES
    }
    mixed = {(c.bits, c.group_qmax, c.dtype, c.variant) for c in cases if c.group_qmax}
    assert mixed == {
        (b, (q, *_identity.ladder_qmax(b)[:: len(_identity.ladder_qmax(b)) - 1]), getattr(torch, d), v)
        for b, q in ((4, 7), (8, 127))
        for d in _precompile.DTYPES
        for v in ("finite", "adversarial")
    }


def test_the_precompile_plan_splits_the_grid_over_the_workers(tmp_path, monkeypatch):
    grid = _precompile.default_grid()
    for workers in (1, 2, 5, 16, 100):
        parts = _precompile.shares(grid, workers)
        assert len(parts) == min(workers, len(grid)) and all(parts)
        assert sorted(e.label() for p in parts for e in p) == sorted(e.label() for e in grid)
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    listed = _precompile.precompile(grid, torch.device("cpu"), workers=16)
    assert listed["ran"] is False and listed["grid"] == [e.label() for e in grid]
    assert listed["workers"] == 16 and listed["cache_dir"] == str(tmp_path / "cache")
    assert _precompile.sizes(128) == (8192, 8256, 8259)  # whole tiles; a tail with n % 16 == 0 and != 0
    # The pool itself, on the CPU codec: spawned workers each run their share.
    ran = _precompile.precompile(grid[:4], torch.device("cpu"), workers=2, force_pool=True)
    assert ran["ran"] is True and set(ran["seconds"]) == {e.label() for e in grid[:4]}


def test_a_pytest_step_killed_at_its_budget_counts_the_tests_that_ended(tmp_path, monkeypatch):
    """pytest runs with -v, so its output names each test as it ends: a kill at the budget
    still tells how many ran, and a failure among them fails the step."""
    lines = [
        "tests/gpu/test_a.py::test_one PASSED [  1%]",
        "tests/gpu/test_a.py::test_two[int8] PASSED [  2%]",
        "tests/gpu/test_b.py::test_three ",
    ]

    def killed(cmd, **kw):
        assert "-v" in cmd and 11.0 < kw["timeout"] <= 12.0
        kw["stdout"].write("\n".join(lines))
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(validate.subprocess, "run", killed)
    step = validate.step_pytest(torch.device("cpu"), False, 12.0, tmp_path, tmp_path)
    assert step.status == "INCOMPLETE" and step.data["passed"] == 2 and step.data["killed"] is True
    assert step.detail.startswith("killed at its budget of 12 s after 2 tests: 0 failed")
    assert (tmp_path / "pytest.log").read_text().startswith("tests/gpu/test_a.py::test_one PASSED")
    lines.insert(1, "tests/gpu/test_a.py::test_bad FAILED [  1%]")
    step = validate.step_pytest(torch.device("cpu"), False, 12.0, tmp_path, tmp_path)
    assert step.status == "FAIL" and step.data["failed"] == 1


def test_a_killed_pytest_step_counts_the_lines_of_xdist_workers_too(tmp_path, monkeypatch):
    """With pytest-xdist (the GPU image has it) the step runs the tests on several workers,
    whose -v lines put the outcome first; the count of a killed run reads both forms."""
    lines = [
        "[gw0] [  1%] PASSED 2.1s tests/gpu/test_a.py::test_one ",
        "[gw3] [ 12%] FAILED 0.4s tests/gpu/test_a.py::test_two[int8] ",
        "tests/gpu/test_b.py::test_three SKIPPED 0.0s (needs CUDA) [ 20%]",
    ]
    seen = {}

    def killed(cmd, **kw):
        seen["cmd"] = cmd
        kw["stdout"].write("\n".join(lines))
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(validate.subprocess, "run", killed)
    monkeypatch.setattr(validate, "pytest_workers", lambda: 6)
    step = validate.step_pytest(torch.device("cpu"), False, 12.0, tmp_path, tmp_path)
    assert seen["cmd"][-4:] == ["-k", f"not {HUGE}", "-n", "6"]  # the huge tests come after, alone
    assert (step.data["passed"], step.data["failed"], step.data["skipped"]) == (1, 1, 1)
    assert step.status == "FAIL"
    monkeypatch.setattr(validate, "pytest_workers", lambda: 0)  # no xdist: one process
    validate.step_pytest(torch.device("cpu"), False, 12.0, tmp_path, tmp_path)
    assert "-n" not in seen["cmd"]


HUGE_NAMES = tuple(f"{HUGE}_{c}" for c in "abcd")
SMALL_NAMES = tuple(f"small_{c}" for c in "efghij")


def test_with_workers_the_huge_tests_run_after_them_in_one_process(tmp_path, monkeypatch) -> None:
    """Two tests of tens of GiB at once would not fit in the device: with pytest-xdist the
    step runs every other test on the workers, then the huge ones in one process, one after
    the other; the counts add up over both runs. (xdist's loadgroup, which did this before,
    no longer groups under pytest 9.2.)"""
    pytest.importorskip("xdist")
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        "def pytest_configure(config):\n    config.addinivalue_line('markers', 'cuda: a GPU test')\n"
    )
    record = tmp_path / "ran"
    record.mkdir()
    (suite / "test_huge.py").write_text(
        "import os, time, pytest\n\n"
        + "".join(
            f"@pytest.mark.cuda\ndef test_{name}():\n"
            f"    start = time.monotonic()\n    time.sleep(0.05)\n"
            f"    open({str(record / name)!r}, 'w').write("
            f"os.environ.get('PYTEST_XDIST_WORKER', 'main') + ' ' + repr((start, time.monotonic())))\n\n"
            for name in HUGE_NAMES + SMALL_NAMES
        )
    )
    monkeypatch.setattr(validate.subprocess, "run", _pytest_on(suite, subprocess.run))
    monkeypatch.setattr(validate, "pytest_workers", lambda: 2)
    # Run on an xdist worker itself, this test must not hand its own worker's name down.
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    out.mkdir()
    step = validate.step_pytest(torch.device("cpu"), False, 120.0, tmp_path, out)
    assert step.status == "PASS" and step.data["tests"] == 10, (step.detail, (out / "pytest.log").read_text())
    assert step.data["returncodes"] == [0, 0] and len(step.data["commands"]) == 2
    ran = {p.name: p.read_text().split(" ", 1) for p in record.iterdir()}
    assert {ran[name][0] for name in HUGE_NAMES} == {"main"}  # not on a worker
    assert {ran[name][0] for name in SMALL_NAMES} <= {"gw0", "gw1"}
    spans = sorted(eval(ran[name][1]) for name in HUGE_NAMES)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # one after another
    assert max(eval(ran[n][1])[1] for n in SMALL_NAMES) <= spans[0][0]  # after the workers
    # Both runs' lines are in the one log, the huge tests' last.
    assert len(re.findall(validate._ENDED.format("PASSED"), (out / "pytest.log").read_text())) == 10
    assert not (out / "pytest-huge.xml").exists() and (tmp_path / "pytest-huge.xml").exists()


def test_a_command_killed_during_the_pytest_step_keeps_its_log(tmp_path, monkeypatch):
    """The pytest output goes to pytest.log as it is written, unbuffered: when the whole
    command is killed at its limit mid-pytest, the lines of the tests that ended are there."""
    seen = {}

    def killed_with_the_command(cmd, **kw):
        seen["unbuffered"] = kw["env"]["PYTHONUNBUFFERED"]
        kw["stdout"].write("tests/gpu/test_a.py::test_one PASSED [  1%]\n")
        kw["stdout"].flush()
        raise KeyboardInterrupt  # stands for the kill: nothing after this line runs

    monkeypatch.setattr(validate.subprocess, "run", killed_with_the_command)
    with pytest.raises(KeyboardInterrupt):
        validate.step_pytest(torch.device("cpu"), False, 12.0, tmp_path, tmp_path)
    assert (tmp_path / "pytest.log").read_text() == "tests/gpu/test_a.py::test_one PASSED [  1%]\n"
    assert seen["unbuffered"] == "1"


def _pytest_on(tests: Path, real: Callable) -> Callable:
    """``subprocess.run`` for the pytest step that runs the real pytest on ``tests`` (for
    the suite's folder and the huge tests' folder alike)."""

    def run(cmd, **kw):
        return real([str(tests) if c in ("tests", HUGE_HOME) else c for c in cmd], **kw)

    return run


def test_the_huge_tests_are_all_in_the_folder_their_run_collects():
    """With workers, the huge tests run apart, collected from HUGE_HOME alone; one elsewhere
    would be left out of both runs."""
    found = {
        path.parent.relative_to(REPO).as_posix()
        for path in (REPO / "tests").rglob("test_*.py")
        if re.search(rf"def test_\w*{HUGE}", path.read_text()) and path.name != "test_gpu_validate.py"
    }
    assert found == {HUGE_HOME}
    runs = validate.pytest_runs(4, Path("a.xml"), Path("b.xml"))
    assert runs[0][0][runs[0][0].index("-k") + 1] == f"not {HUGE}" and "tests" in runs[0][0]
    assert (
        HUGE_HOME in runs[1][0] and runs[1][0][runs[1][0].index("-k") + 1] == HUGE and "-n" not in runs[1][0]
    )
    assert [args for args, _ in validate.pytest_runs(0, Path("a.xml"), Path("b.xml"))] == [
        ["-v", "-m", "cuda", "-p", "no:cacheprovider", "-p", "_gpu_pytest", "tests", "--junitxml=a.xml"]
    ]


@pytest.mark.parametrize("cuda_test_skips", [False, True])
def test_a_module_that_skips_on_import_does_not_fail_the_pytest_step(tmp_path, monkeypatch, cuda_test_skips):
    """The GPU image lacks the optional extras (transformers, accelerate, lightning): their
    test modules skip themselves on import, which the junit XML counts as skipped tests even
    under -m cuda. Those are not cuda tests; a cuda test that skips still fails the step."""
    tests = tmp_path / "suite"
    tests.mkdir()
    (tests / "conftest.py").write_text(
        "def pytest_configure(config):\n    config.addinivalue_line('markers', 'cuda: a GPU test')\n"
    )
    (tests / "test_extra.py").write_text(
        "import pytest\n"
        "pytest.importorskip('tw_no_such_extra', reason='the extra is not installed')\n"
        "def test_uses_the_extra():\n"
        "    pass\n"
    )
    body = "pytest.skip('no GPU after all')" if cuda_test_skips else "pass"
    (tests / "test_gpu.py").write_text(
        f"import pytest\n@pytest.mark.cuda\ndef test_on_the_gpu():\n    {body}\n"
    )
    monkeypatch.setattr(validate.subprocess, "run", _pytest_on(tests, subprocess.run))
    if cuda_test_skips:
        monkeypatch.setattr(validate, "pytest_workers", lambda: 0)  # one case in one process
    out = tmp_path / "out"
    out.mkdir()
    step = validate.step_pytest(torch.device("cpu"), False, 120.0, tmp_path, out)
    assert step.data["tests"] == 1 and step.data["failures"] == 0 and step.data["errors"] == 0
    assert len(step.data["modules_skipped_on_import"]) == 1
    assert "the extra is not installed" in step.data["modules_skipped_on_import"][0]
    if cuda_test_skips:
        assert step.status == "FAIL" and step.data["skipped"] == 1, step.detail
    else:
        assert step.status == "PASS" and step.data["skipped"] == 0, step.detail
        assert step.detail.endswith("1 module(s) of optional extras skipped on import")


def test_a_test_of_more_gpus_than_the_machine_has_is_listed_not_failed(tmp_path, monkeypatch):
    """A ``cuda(devices=2)`` test on a one-GPU machine is skipped by the suite's conftest;
    the step lists it apart and still passes. Any other skip of a cuda test fails it."""
    tests = tmp_path / "suite"
    tests.mkdir()
    shutil.copy(REPO / "tests" / "conftest.py", tests / "conftest.py")
    (tests / "test_gpus.py").write_text(
        "import pytest\n"
        "@pytest.mark.cuda\ndef test_one():\n    pass\n"
        "@pytest.mark.cuda(devices=2)\ndef test_two():\n    pass\n"
    )
    monkeypatch.setenv("TW_TRITON_TEST_ASSUME_CUDA", "1")
    monkeypatch.setenv("TW_TRITON_TEST_ASSUME_CUDA_DEVICES", "1")
    monkeypatch.setattr(validate.subprocess, "run", _pytest_on(tests, subprocess.run))
    monkeypatch.setattr(validate, "pytest_workers", lambda: 0)
    out = tmp_path / "out"
    out.mkdir()
    step = validate.step_pytest(torch.device("cpu"), False, 120.0, tmp_path, out)
    assert step.status == "PASS" and step.data["skipped"] == 0, step.detail
    (listed,) = step.data["needs_more_devices"]
    assert "test_two" in listed and "needs 2 CUDA devices, this machine has 1" in listed
    assert step.detail.endswith("1 test(s) of more GPUs than this machine has not run")


def test_precompile_all_runs_every_entry_of_its_grid() -> None:
    """Every entry of the full grid resolves its params as a rule would; the first GPU run
    failed here on ``bitmask`` (which takes neither ``bits`` nor ``block``). One entry of each
    codec runs end to end on the CPU, where nothing compiles."""
    grid = validate.precompile_all_grid(dry=False)
    for entry in grid:
        _precompile.entry_params(entry)
    first = {}
    for entry in grid:
        first.setdefault(entry.codec, entry)
    assert "bitmask" in first
    for entry in first.values():
        _precompile.run_entry(entry, torch.device("cpu"))


def test_pytest_failures_are_written_as_they_happen_and_the_huge_tests_run_last(tmp_path: Path) -> None:
    """The GPU run's pytest step loads _gpu_pytest: a failing test's traceback is in the file
    before pytest's end-of-run summary (which a killed run never prints), and the tests that
    allocate tens of GiB run after every other."""
    test = tmp_path / "test_fails.py"
    test.write_text(
        "def test_int64_offsets_past_2_31():\n    pass\n\n"
        "def test_boom():\n    assert 1 + 1 == 3, 'arithmetic'\n\n"
        "import time, pytest\n\n@pytest.fixture\ndef slow():\n    time.sleep(0.2)\n\n"
        "def test_ok(slow):\n    pass\n"
    )
    log = tmp_path / "failures.log"
    env = {**_env(), "PYTHONPATH": str(GPU_DIR), "TW_PYTEST_FAILURES": str(log)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "_gpu_pytest", "-p", "no:cacheprovider", str(test)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stdout
    text = log.read_text()
    assert "test_fails.py::test_boom (call)" in text and "arithmetic" in text
    assert "test_ok" not in text
    order = re.findall(r"::(test_\w+) (?:PASSED|FAILED)", proc.stdout)
    assert order == ["test_boom", "test_ok", "test_int64_offsets_past_2_31"], proc.stdout
    # Each line says how long its test took, setup included (the fixture sleeps 0.2 s).
    seconds = dict(re.findall(r"::(test_\w+) (?:PASSED|FAILED) (\d+\.\d)s", proc.stdout))
    assert set(seconds) == set(order) and float(seconds["test_ok"]) >= 0.2, proc.stdout
