"""tools/sass_count.py's count: up to the first EXIT, less the blocks a skipped branch jumps over."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import sass_count  # noqa: E402

SASS = """Function:k
--:-:-:-:1\tLDC R1, c[0x0][0x28];
--:-:-:-:5\t@!P2 BRA LBB1;
--:-:-:-:1\tFMUL R7, R7, R0;
--:-:-:-:1\tFMUL R4, R4, R0;
LBB1:
--:-:-:-:1\t@P3 FADD R0, R0, 1;
--:-:-:-:5\tEXIT;
--:-:-:-:1\tFFMA R3, R0, R1, R2;
"""


def test_count_stops_at_the_first_exit_and_leaves_out_skipped_blocks():
    total, ops = sass_count.count(SASS, set())
    assert total == 6 and ops == {"LDC": 1, "BRA": 1, "FMUL": 2, "FADD": 1, "EXIT": 1}
    total, ops = sass_count.count(SASS, {"LBB1"})
    assert total == 4 and "FMUL" not in ops and ops["FADD"] == 1
