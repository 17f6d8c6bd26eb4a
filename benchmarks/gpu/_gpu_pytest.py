"""The pytest plugin of the GPU run's ``pytest -m cuda`` step (``-p _gpu_pytest``).

* Each failure's traceback is appended to the file named by ``$TW_PYTEST_FAILURES`` as the
  test ends: a pytest killed at its budget (its summary is printed only at the end) still
  brings back why the tests that ran failed.
* The tests that allocate tens of GiB (the int64 offset windows) run last: on the first
  H100 run the budget ran out inside one of them with 87 tests not yet started. With
  pytest-xdist the step runs them in a process of their own after the workers' run, so
  never two at once (``validate.pytest_runs``).
* Each test's ``-v`` line carries its seconds (setup and call): ``... PASSED 2.4s [ 5%]``.
  The first H100 run's log could not say which of its 53 tests took the 150 s budget.

    PYTHONPATH=benchmarks/gpu TW_PYTEST_FAILURES=$OUT/failures.log python -m pytest -p _gpu_pytest ...
"""

from __future__ import annotations

import os

import pytest

# In the names of the tests that allocate tens of GiB (validate.py selects them by it too),
# all in one folder (tests/gpu/test_gpu_validate.py checks it).
HUGE = "int64_offsets_past"
HUGE_HOME = "tests/ops"


def _huge(item) -> bool:
    return HUGE in item.name


def pytest_collection_modifyitems(session, config, items) -> None:
    items.sort(key=_huge)  # stable: the rest keep their order


_setup_s: dict[str, float] = {}
_worker = False  # an xdist worker: its controller writes the failures it is sent


def pytest_configure(config) -> None:
    global _worker
    _worker = hasattr(config, "workerinput")


@pytest.hookimpl(hookwrapper=True)
def pytest_report_teststatus(report, config):
    outcome = yield
    status = outcome.get_result()
    # A test's line is written for its call, or for its setup when that failed or skipped.
    if not status or not status[2] or not (report.when == "call" or report.outcome != "passed"):
        return
    category, letter, word = status
    seconds = report.duration + (_setup_s.pop(report.nodeid, 0.0) if report.when == "call" else 0.0)
    if isinstance(word, tuple):
        word = (f"{word[0]} {seconds:.1f}s", *word[1:])
    else:
        word = f"{word} {seconds:.1f}s"
    outcome.force_result((category, letter, word))


def pytest_runtest_logreport(report) -> None:
    if report.when == "setup":
        _setup_s[report.nodeid] = report.duration
    path = os.environ.get("TW_PYTEST_FAILURES")
    if not path or not report.failed or _worker:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
