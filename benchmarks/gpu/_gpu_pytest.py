"""The pytest plugin of the GPU run's ``pytest -m cuda`` step (``-p _gpu_pytest``).

* Each failure's traceback is appended to the file named by ``$TW_PYTEST_FAILURES`` as the
  test ends: a pytest killed at its budget (its summary is printed only at the end) still
  brings back why the tests that ran failed.
* The tests that allocate tens of GiB (the int64 offset windows) run last: on the first
  H100 run the budget ran out inside one of them with 87 tests not yet started.

    PYTHONPATH=benchmarks/gpu TW_PYTEST_FAILURES=$OUT/failures.log python -m pytest -p _gpu_pytest ...
"""

from __future__ import annotations

import os

LAST = ("int64_offsets_past",)


def pytest_collection_modifyitems(session, config, items) -> None:
    items.sort(key=lambda item: any(name in item.name for name in LAST))  # stable: the rest keep their order


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("TW_PYTEST_FAILURES")
    if not path or not report.failed:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
