"""Which side of the log2 bits=8 bf16 decode differs on a GPU (first H100 run): the same
CPU-encoded codes decoded by the Triton kernel, by the torch spec on CUDA tensors, by the
torch spec on the CPU and by the compiled CPU codec, in each output dtype.

    python benchmarks/gpu/diag_log2.py [OUT_DIR]
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _identity  # noqa: E402

from tw_triton.ops.backends import native  # noqa: E402
from tw_triton.ops.reference import dequantize_log2_torch, quantize_log2_torch  # noqa: E402


def bits_of(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()]).to(torch.int64) & (
        (1 << (8 * t.element_size())) - 1
    )


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from tw_triton import kernels as K

    report: dict = {"device": str(dev), "cpu": platform.processor(), "cases": []}
    try:
        report["cpu_model"] = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
        report["cpu_flags"] = [f for f in flags if f.startswith(("avx", "fma", "f16c"))]
        report["cc_version"] = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout[
            :200
        ]
    except Exception as exc:  # noqa: BLE001 - facts only
        report["cpu_error"] = repr(exc)
    report["native_library"] = str(getattr(native.library(), "_name", None))
    for bits in (8, 4):
        for block in (32, 128):
            case = _identity.Case("log2", bits, block, torch.bfloat16, "nonneg", "contiguous", None)
            x, _ = _identity.make_input(case, 0)
            n = x.numel()
            codes, lo, hi = quantize_log2_torch(x, bits, block)
            if dev.type == "cuda":
                codes_d, lo_d, hi_d = (t.to(dev) for t in (codes, lo, hi))
                enc_k = K.quantize_log2(x.to(dev), bits, block)
                enc_same = all(torch.equal(a.cpu(), b) for a, b in zip(enc_k, (codes, lo, hi)))
            else:
                codes_d, lo_d, hi_d, enc_same = codes, lo, hi, None
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                ways = {"torch_cpu": dequantize_log2_torch(codes, lo, hi, n, bits, block, dtype)}
                nat = torch.empty(n, dtype=dtype)
                try:
                    got = native.decode_log2(codes, lo, hi, n, bits, block, nat)
                    if got is not None and got is not False:
                        ways["native_cpu"] = nat
                except Exception as exc:  # noqa: BLE001
                    report.setdefault("native_errors", []).append(repr(exc))
                if dev.type == "cuda":
                    ways["kernel"] = K.dequantize_log2(codes_d, lo_d, hi_d, n, bits, block, dtype)
                    ways["torch_cuda"] = dequantize_log2_torch(codes_d, lo_d, hi_d, n, bits, block, dtype)
                    torch.cuda.synchronize()
                b = {k: bits_of(v) for k, v in ways.items()}
                diffs = {
                    f"{p} vs torch_cpu": int((b[p] != b["torch_cpu"]).sum()) for p in b if p != "torch_cpu"
                }
                row = {
                    "bits": bits,
                    "block": block,
                    "dtype": str(dtype),
                    "n": n,
                    "encode_same": enc_same,
                    "diffs": diffs,
                    "samples": [],
                }
                worst = next((p for p in b if p != "torch_cpu" and diffs[f"{p} vs torch_cpu"]), None)
                if worst is not None:
                    idx = (b[worst] != b["torch_cpu"]).nonzero().squeeze(1)[:12]
                    u = codes.to(torch.int64) if bits == 8 else None
                    for i in idx.tolist():
                        blk = i // block
                        row["samples"].append(
                            {
                                "i": i,
                                "x": float(x[i]),
                                "code": None if u is None else int(u[i]),
                                "lo": int(lo[blk]),
                                "hi": int(hi[blk]),
                                **{k: hex(int(v[i])) for k, v in b.items()},
                            }
                        )
                report["cases"].append(row)
                print(json.dumps(row), flush=True)
    (out_dir / "diag_log2.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "cases"}), flush=True)


if __name__ == "__main__":
    main()
