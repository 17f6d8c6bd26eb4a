"""Pruned weights stored by the ``bitmask`` codec, side by side with today's lossless path.

The linear weights of all-MiniLM-L6-v2 (the 36 ``encoder.*.weight`` matrices, 21.3M of its
22.7M parameters) are pruned three ways: 50 % unstructured by magnitude per tensor (pruned
entries set to +0), 2:4 (the two smallest magnitudes of every 4 consecutive inputs), and
``torch.nn.utils.prune.l1_unstructured`` at 50 % followed by ``prune.remove`` (which
multiplies by the mask and so leaves ``-0.0`` where a negative weight was pruned). Each
pruned model, in fp32 and in bf16, is written with ``tw_triton.save`` and the stored bytes
of the pruned tensors are read from the file's manifest:

* raw: the tensors' bytes;
* exact + entropy: ``rules="exact", sparse=False``, the default entropy policy (today's
  lossless path), and the smallest of every lossless stage forced on every buffer
  (``zstd``, ``zstd-bytegroup``, ``zstd-planes``): today's best;
* bitmask: the mask and the non-zero values raw (no entropy stage), and with the default
  entropy policy (what ``quantize_state_dict`` now chooses by itself).

A sweep of light magnitude pruning (2 % to 30 % zeros) shows where the automatic choice
switches and what the mask gains there. Deltas (on unless ``--no-deltas``): the 50 % pruned fp32 weights move where they are not pruned (zeros
stay zero); the int8 blockwise delta (block 128) against the pruned keyframe, with the
entropy stage, against a bitmask of its codes (the mask and the non-zero codes, each
through the entropy stage) and against codes at the reference's non-zero positions only
(a decoder that knows the keyframe's mask needs no mask stored).

Run: ``python benchmarks/sparse.py`` (a minute or two on 2 cores). Needs the ``bench``
extra for the model. Writes ``benchmarks/results/sparse.json`` and ``sparse.md``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.utils.prune
from harness.common import RESULTS_DIR, environment, fmt_table, log, write_result

import tw_triton
from tw_triton.codecs.blockwise import quantize
from tw_triton.codecs.entropy import EntropyPolicy
from tw_triton.codecs.entropy.policy import AUTO, encode_buffer

STAGES = ("zstd", "zstd-bytegroup", "zstd-planes")


def prunable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The encoder's linear weights by state-dict name (fp32 copies)."""
    return {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if k.startswith("encoder.") and k.endswith(".weight") and v.dim() == 2
    }


def magnitude(w: torch.Tensor, fraction: float) -> torch.Tensor:
    """``w`` with its ``fraction`` smallest magnitudes set to +0."""
    k = int(fraction * w.numel())
    threshold = w.abs().view(-1).kthvalue(k).values
    return torch.where(w.abs() > threshold, w, torch.zeros((), dtype=w.dtype))


def two_of_four(w: torch.Tensor) -> torch.Tensor:
    """``w`` with the 2 smallest magnitudes of each 4 consecutive inputs set to +0."""
    groups = w.reshape(-1, 4)
    drop = groups.abs().argsort(dim=1)[:, :2]
    return groups.scatter(1, drop, 0.0).view_as(w)


def torch_prune(w: torch.Tensor, fraction: float) -> torch.Tensor:
    """``torch.nn.utils.prune.l1_unstructured`` and ``prune.remove`` on a linear layer."""
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    torch.nn.utils.prune.l1_unstructured(layer, "weight", amount=fraction)
    torch.nn.utils.prune.remove(layer, "weight")
    return layer.weight.detach().clone()


PRUNINGS = {
    "50% unstructured (magnitude)": lambda w: magnitude(w, 0.5),
    "2:4 (magnitude)": two_of_four,
    "50% torch.nn.utils.prune": lambda w: torch_prune(w, 0.5),
}


def stored_bytes(
    state: dict[str, torch.Tensor], path: Path, *, sparse: bool, entropy: Any, rules: Any = "exact"
) -> dict[str, Any]:
    """Write ``state`` (every tensor exact, or bitmask where it pays) and read back the stored
    bytes of each entry and the codecs the file records."""
    q = tw_triton.quantize_state_dict(state, rules=rules, sparse=sparse)
    tw_triton.save(q, path, fsync=False, entropy=entropy)
    manifest = tw_triton.format.read_manifest(path)
    total = 0
    codecs: set[str] = set()
    for entry in manifest["entries"].values():
        codecs.add(entry["codec"])
        total += sum(b["data_offsets"][1] - b["data_offsets"][0] for b in entry["buffers"].values())
    back = tw_triton.load(path)
    for k, v in state.items():
        assert torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)), f"{k} did not round-trip"
    return {"bytes": total, "codecs": sorted(codecs)}


def measure_pruned(weights: dict[str, torch.Tensor], tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for label, prune in PRUNINGS.items():
        pruned32 = {k: prune(w) for k, w in weights.items()}
        for dtype in (torch.float32, torch.bfloat16):
            state = {k: v.to(dtype) for k, v in pruned32.items()}
            n = sum(v.numel() for v in state.values())
            zeros = sum(
                int((v.view(torch.int16 if dtype == torch.bfloat16 else torch.int32) == 0).sum())
                for v in state.values()
            )
            negzero = sum(int(((v == 0) & v.signbit()).sum()) for v in state.values())
            raw = sum(v.numel() * v.element_size() for v in state.values())
            exact_auto = stored_bytes(state, tmp / "e.tw", sparse=False, entropy="auto")
            per_stage = {
                s: stored_bytes(state, tmp / "e.tw", sparse=False, entropy=EntropyPolicy(stage=s))["bytes"]
                for s in STAGES
            }
            best_stage = min(per_stage, key=per_stage.get)
            exact_best = min(exact_auto["bytes"], per_stage[best_stage])
            bitmask_raw = stored_bytes(state, tmp / "b.tw", sparse=True, entropy=None)
            bitmask = stored_bytes(state, tmp / "b.tw", sparse=True, entropy="auto")
            row = {
                "pruning": label,
                "dtype": str(dtype).removeprefix("torch."),
                "tensors": len(state),
                "elements": n,
                "zero_bit_patterns": zeros,
                "negative_zeros": negzero,
                "raw_bytes": raw,
                "exact_entropy_auto_bytes": exact_auto["bytes"],
                "exact_stage_bytes": per_stage,
                "exact_best_bytes": exact_best,
                "bitmask_raw_bytes": bitmask_raw["bytes"],
                "bitmask_entropy_bytes": bitmask["bytes"],
                "bitmask_codecs": bitmask["codecs"],
                "vs_raw": raw / bitmask["bytes"],
                "vs_best_lossless": exact_best / bitmask["bytes"],
            }
            rows.append(row)
            log(
                f"{label} {row['dtype']}: raw {raw}, exact best {exact_best}, bitmask {bitmask['bytes']} "
                f"({row['vs_raw']:.2f}x raw, {row['vs_best_lossless']:.3f}x best lossless)"
            )
    return rows


SWEEP = (0.02, 0.05, 0.1, 0.2, 0.3)


def measure_sweep(weights: dict[str, torch.Tensor], tmp: Path) -> list[dict[str, Any]]:
    """Light magnitude pruning: exact + entropy against bitmask + entropy (forced by a rule),
    and what the automatic choice picks."""
    rows = []
    for fraction in SWEEP:
        pruned32 = {k: magnitude(w, fraction) for k, w in weights.items()}
        for dtype in (torch.float32, torch.bfloat16):
            state = {k: v.to(dtype) for k, v in pruned32.items()}
            exact = stored_bytes(state, tmp / "e.tw", sparse=False, entropy="auto")["bytes"]
            forced = stored_bytes(state, tmp / "b.tw", sparse=False, entropy="auto", rules=[("*", "bitmask")])
            auto = stored_bytes(state, tmp / "a.tw", sparse=True, entropy="auto")
            rows.append(
                {
                    "zero_fraction": fraction,
                    "dtype": str(dtype).removeprefix("torch."),
                    "exact_entropy_bytes": exact,
                    "bitmask_entropy_bytes": forced["bytes"],
                    "auto_codecs": auto["codecs"],
                }
            )
            log(f"sweep {fraction} {dtype}: exact {exact}, bitmask {forced['bytes']}, auto {auto['codecs']}")
    return rows


def staged(t: torch.Tensor) -> int:
    """Bytes of one buffer after the default entropy policy."""
    t = t.contiguous()
    out = encode_buffer(t, memoryview(t.view(torch.uint8).numpy()), AUTO)
    return t.numel() * t.element_size() if out is None else len(out.data)


def measure_deltas(weights: dict[str, torch.Tensor], step: float) -> dict[str, Any]:
    """int8 deltas of moved pruned weights: blockwise codes vs a bitmask of the codes."""
    gen = torch.Generator().manual_seed(0)
    blockwise = bitmask_codes = known_mask = raw = 0
    for w in weights.values():
        keyframe = magnitude(w, 0.5)
        kept = keyframe != 0
        moved = keyframe + kept * torch.randn(w.shape, generator=gen) * step * w.std()
        q = quantize(moved, bits=8, block=128, reference=keyframe)
        codes = q.codes.view(torch.int8)
        scales = staged(q.scales)
        blockwise += staged(q.codes) + scales
        mask, values = tw_triton.ops.bitmask_encode(codes.float())
        bitmask_codes += staged(mask) + staged(values.to(torch.int8)) + scales
        known_mask += staged(codes[kept.view(-1)]) + scales
        raw += moved.numel() * moved.element_size()
    return {
        "step_over_std": step,
        "raw_bytes": raw,
        "blockwise_entropy_bytes": blockwise,
        "bitmask_of_codes_bytes": bitmask_codes,
        "codes_at_reference_nonzeros_bytes": known_mask,
    }


def tables(result: dict[str, Any]) -> str:
    mib = 2**20
    body = [
        [
            r["pruning"],
            r["dtype"],
            f"{r['zero_bit_patterns'] / r['elements']:.1%}",
            f"{r['raw_bytes'] / mib:.2f}",
            f"{r['exact_entropy_auto_bytes'] / mib:.2f}",
            f"{r['exact_best_bytes'] / mib:.2f}",
            f"{r['bitmask_raw_bytes'] / mib:.2f}",
            f"{r['bitmask_entropy_bytes'] / mib:.2f}",
            f"{r['vs_raw']:.2f}x",
            f"{r['vs_best_lossless']:.3f}x",
        ]
        for r in result["pruned"]
    ]
    text = fmt_table(
        [
            "pruning",
            "dtype",
            "zero bit patterns",
            "raw MiB",
            "exact + entropy (auto) MiB",
            "exact + best stage MiB",
            "bitmask raw MiB",
            "bitmask + entropy MiB",
            "vs raw",
            "vs best lossless",
        ],
        body,
    )
    sweep = result.get("sweep")
    if sweep:
        text += "\n\n" + fmt_table(
            ["zeros (magnitude)", "dtype", "exact + entropy MiB", "bitmask + entropy MiB", "gain", "chosen"],
            [
                [
                    f"{r['zero_fraction']:.0%}",
                    r["dtype"],
                    f"{r['exact_entropy_bytes'] / mib:.2f}",
                    f"{r['bitmask_entropy_bytes'] / mib:.2f}",
                    f"{r['exact_entropy_bytes'] / r['bitmask_entropy_bytes']:.3f}x",
                    ", ".join(r["auto_codecs"]),
                ]
                for r in sweep
            ],
        )
    d = result.get("deltas")
    if d:
        text += "\n\n" + fmt_table(
            ["int8 delta (block 128) of the 50% pruned fp32 weights", "MiB", "vs blockwise"],
            [
                [label, f"{d[key] / mib:.3f}", f"{d['blockwise_entropy_bytes'] / d[key]:.3f}x"]
                for label, key in (
                    ("blockwise codes + scales, entropy stage", "blockwise_entropy_bytes"),
                    ("bitmask of the codes (mask + non-zero codes) + scales", "bitmask_of_codes_bytes"),
                    ("codes at the keyframe's non-zeros only + scales", "codes_at_reference_nonzeros_bytes"),
                )
            ],
        )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-deltas", action="store_true", help="skip the delta comparison")
    parser.add_argument("--step", type=float, default=1e-3, help="delta step over each weight's std")
    args = parser.parse_args()
    from harness.minilm import load_minilm

    model, _ = load_minilm()
    weights = prunable(model)
    with tempfile.TemporaryDirectory() as tmp:
        result: dict[str, Any] = {"model": "all-MiniLM-L6-v2", "pruned": measure_pruned(weights, Path(tmp))}
        result["sweep"] = measure_sweep(weights, Path(tmp))
    if not args.no_deltas:
        result["deltas"] = measure_deltas(weights, args.step)
    write_result("sparse", result)
    env = environment()
    n = result["pruned"][0]["elements"]
    text = "\n".join(
        [
            "# Pruned weights: the bitmask codec against today's lossless path",
            "",
            f"Written by `python benchmarks/sparse.py`. {env['machine']}. The {result['pruned'][0]['tensors']} "
            f"linear weights of all-MiniLM-L6-v2 ({n / 1e6:.1f}M elements), pruned; stored bytes of those "
            "tensors in a file written by `tw_triton.save`, read from its manifest; every file "
            'read back bit for bit. "Best lossless" is the smaller of the default policy and '
            f"each of {', '.join(STAGES)} forced on every buffer.",
            "",
            tables(result),
            "",
        ]
    )
    (RESULTS_DIR / "sparse.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
