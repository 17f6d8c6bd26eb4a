"""A pytest plugin for the GPU run: each failure's traceback is appended to the file named by
``$TW_PYTEST_FAILURES`` as the test ends, so a pytest killed at its budget (its summary is
printed only at the end) still brings back why the tests that ran failed.

    PYTHONPATH=benchmarks/gpu TW_PYTEST_FAILURES=$OUT/failures.log python -m pytest -p _instafail ...
"""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("TW_PYTEST_FAILURES")
    if not path or not report.failed:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
