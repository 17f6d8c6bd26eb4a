"""Count one kernel variant's sm_90 (or sm_80) SASS instructions, with no GPU.

Compiles the variant as ``tests/_ptx.py`` does (the JIT's specialization, no FMA
contraction), then counts the instructions up to the first ``EXIT`` (itself included) per
opcode: a thread's work on one tile when no branch is taken. ``--skip LBB3 ...`` also leaves out the
blocks that a ``@!P BRA LBB3`` jumps over (a careful path a tile does not take): read the
disassembly (``--sass FILE``) for their labels. The fast-path counts in
docs/gpu-validation.md are these, with each exact-tie branch's body replaced by one add
in a scratch copy of the kernel.

    python tools/sass_count.py encode 8 128 bf16 --ref bf16
    python tools/sass_count.py log2-encode 4 128 bf16 --sass /tmp/l.sass
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import _ptx  # noqa: E402

_LINE = re.compile(r"^\S+\t(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_SKIP = re.compile(r"@!?U?P\w+ BRA (LBB\w+);")


def count(sass: str, skip: set[str]) -> tuple[int, Counter]:
    """Instructions up to the first ``EXIT`` outside the skipped blocks, and by opcode."""
    ops: Counter = Counter()
    skipping = None
    for line in sass.splitlines():
        label = line.strip().rstrip(":")
        if skipping and label == skipping:
            skipping = None
            continue
        m = _LINE.match(line)
        if not m or skipping:
            continue
        op = m.group(1).split(".")[0]
        ops[op] += 1
        if op == "EXIT":
            break
        jump = _SKIP.search(line)
        if jump and jump.group(1) in skip:
            skipping = jump.group(1)
    return sum(ops.values()), ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("op", help="a tests/_ptx.py Variant op: encode, decode, log2-encode, temporal-encode, ...")
    p.add_argument("bits", type=int)
    p.add_argument("block", type=int)
    p.add_argument("dtype", choices=_ptx.DTYPES)
    p.add_argument("--ref", default=None, choices=_ptx.DTYPES, help="the reference's dtype, if any")
    p.add_argument("--masked", action="store_true", help="the tail launch")
    p.add_argument("--cc", type=int, default=90, choices=_ptx.TARGETS)
    p.add_argument("--skip", nargs="*", default=[], help="labels whose jumped-over blocks are left out")
    p.add_argument("--sass", default=None, help="write the disassembly here")
    args = p.parse_args()
    v = _ptx.Variant(args.op, args.bits, args.block, args.dtype, args.ref, args.masked, args.cc)
    sass = _ptx.compile_variant(v).asm["sass"]
    if args.sass:
        Path(args.sass).write_text(sass)
    total, ops = count(sass, set(args.skip))
    print(f"{v.label}: {total} instructions up to the first EXIT")
    print(", ".join(f"{op} {n}" for op, n in ops.most_common()))


if __name__ == "__main__":
    main()
