"""Helpers shared by the benchmark scripts: machine description, result files, statistics.

The benchmarks are scripts, not library code: they live outside the ``tw_triton`` package
and import it like a user would. Every number they print is also written to a JSON file
under ``benchmarks/results/`` so that ``make_results.py`` can rebuild the results page
without rerunning anything.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"


def machine_description() -> str:
    """One line naming the machine the numbers come from (CPU model, cores, GPU or none)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = os.cpu_count() or 0
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    else:
        gpu = "no GPU"
    return f"{cores}-core {platform.machine()} VM ({cpu}), {gpu}"


def environment() -> dict[str, Any]:
    """Versions and thread count that shape the numbers, stored next to them."""
    import safetensors

    import tw_triton
    import tw_triton.format.checksum

    return {
        "machine": machine_description(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "tw_triton": tw_triton.__version__,
        "torch_threads": torch.get_num_threads(),
        "crc32": tw_triton.format.checksum.CRC32_LIBRARY,
    }


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (plus the environment) to ``results/<name>.json``; return the path."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    data = {"environment": environment(), **payload}
    path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    return path


def read_result(name: str) -> dict[str, Any]:
    """Read ``results/<name>.json`` as written by :func:`write_result`."""
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8"))


def median(values: list[float]) -> float:
    """Median of a non-empty list (the statistic every timing table reports)."""
    return float(statistics.median(values))


def mib(nbytes: float) -> float:
    """Bytes to MiB."""
    return nbytes / (1 << 20)


def fmt_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table; floats are printed as given (pre-format them)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def log(msg: str) -> None:
    """Progress line on stderr, so stdout carries only the tables."""
    print(msg, file=sys.stderr, flush=True)


def device_slug(name: str) -> str:
    """A folder name for a device: ``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    import re

    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def gpu_results_dir(device: torch.device | None = None) -> Path:
    """``results/gpu/<device-name-slug>/`` for the current (or given) CUDA device, created."""
    path = RESULTS_DIR / "gpu" / device_slug(torch.cuda.get_device_name(device))
    path.mkdir(parents=True, exist_ok=True)
    return path
