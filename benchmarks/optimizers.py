"""Every optimizer of torch.optim through the Checkpointer's defaults: sizes, restore, resumed run.

Per optimizer: a 1.6 M-parameter MLP regressing a fixed random teacher, 12 saves 5 steps apart
with ``Checkpointer()`` defaults (preset ``smallest``, closed loop, a keyframe every 10
saves). Reported: keyframe and delta sizes as ratios against ``torch.save`` of the same
state; what each optimizer state is coded as and the weight-delta bits chosen (from the
files' manifests); the restored weights' relative error (largest over tensors); and a
resumed run: 30 more steps from the restored state against 30 from the saved one, the
held-out loss gap over the gap between two data orders (the noise floor; under 1 is
within it).

Run: ``python benchmarks/optimizers.py`` (about 3 minutes on 2 cores) writes
``results/optimizers.{json,md}``; ``--quick`` (a small model, 4 saves) writes nothing
unless ``--out`` names a result.
"""

from __future__ import annotations

import argparse
import copy
import io
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.common import RESULTS_DIR, fmt_table, log, machine_description, median, write_result  # noqa: E402

import tw_triton  # noqa: E402
from tw_triton import Checkpointer, roles  # noqa: E402
from tw_triton.rules import DEFAULT_MIN_NUMEL  # noqa: E402

OPTIONS: dict[str, dict[str, Any]] = {
    "Adam": {"amsgrad": True},
    "SGD": {"lr": 0.1, "momentum": 0.9},
    "RMSprop": {"momentum": 0.9},
    "Muon": {"lr": 0.02},
    "LBFGS": {"max_iter": 4, "history_size": 4},
}


class Rows(torch.nn.Module):
    """SparseAdam's model: an embedding (sparse gradients) whose rows feed the MLP's input."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(6 * width, width // 4, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = (x[:, 0].abs() * 1000).long() % self.emb.num_embeddings
        return torch.tanh(self.emb(idx))


def build(name: str, width: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    bias = name != "Muon"  # Muon takes matrices only
    model = (
        Rows(width)
        if name == "SparseAdam"
        else torch.nn.Sequential(
            torch.nn.Linear(width // 4, width, bias=bias),
            torch.nn.Tanh(),
            torch.nn.Linear(width, width, bias=bias),
            torch.nn.Tanh(),
            torch.nn.Linear(width, width // 4, bias=bias),
        )
    )
    return model, getattr(torch.optim, name)(model.parameters(), **OPTIONS.get(name, {}))


def batch(width: int, step: int, order: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * order + step)
    x = torch.randn(64, width // 4, generator=g)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(width // 4, width // 4, generator=teacher) / (width // 4) ** 0.5
    return x, torch.sin(x @ w)


def step(model, opt, width: int, i: int, order: int = 0) -> None:
    x, y = batch(width, i, order)

    def closure():
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        return loss

    opt.step(closure)


def held_out(model, width: int) -> float:
    with torch.no_grad():
        x, y = batch(width, 10**6, 99)
        return float((model(x) - y).square().mean())


def coded_as(manifest: dict[str, Any]) -> dict[str, Any]:
    """Per optimizer state name, the codecs of its entries; the weight-delta bits chosen, and
    ``(bits, qmax)`` of each (``max_error`` may code fewer levels than a container holds)."""
    names: dict[str, set[str]] = {}
    bits: set[int] = set()
    codes: set[tuple[int, int]] = set()
    for path, entry in manifest["entries"].items():
        parts = path.split("/")
        large = math.prod(entry["shape"]) >= DEFAULT_MIN_NUMEL
        if parts[0] == "optimizer" and parts[1] == "state" and len(parts) > 3 and large:
            b = entry["params"].get("bits")
            label = {"blockwise": f"int{b}", "log2": f"log2 {b}-bit"}.get(entry["codec"], entry["codec"])
            names.setdefault(parts[3], set()).add(label)
        elif parts[0] == "model" and entry["codec"] == "blockwise":
            b = entry["params"]["bits"]
            bits.add(b)
            codes.add((b, entry["params"].get("qmax", (1 << (b - 1)) - 1)))
    return {
        "states": {n: sorted(c) for n, c in sorted(names.items())},
        "weight_bits": sorted(bits),
        "weight_codes": sorted(codes),
    }


def codes_label(codes: list) -> str:
    """``(bits, qmax)`` pairs as ``2, 4 (q3-7), 8 (q9)``: each container with its codes'
    largest magnitudes where they are not just the container's full range."""
    out = []
    for b in sorted({b for b, _ in codes}):
        qs = sorted(q for c, q in codes if c == b)
        full = [q for q in qs if q == (1 << (b - 1)) - 1]
        if qs == full:
            out.append(str(b))
        else:
            out.append(f"{b} (q{qs[0]})" if len(qs) == 1 else f"{b} (q{qs[0]}-{qs[-1]})")
    return ", ".join(out)


def run_one(name: str, width: int, saves: int, every: int, resume_steps: int) -> dict[str, Any]:
    model, opt = build(name, width, 0)
    with tempfile.TemporaryDirectory() as d:
        with Checkpointer(d, fsync=False, keep_last=saves) as ckpt:
            for i in range(saves * every):
                step(model, opt, width, i)
                if i % every == every - 1:
                    ckpt.save(i, model=model, optimizer=opt)
            ckpt.flush()
            infos = ckpt.infos()
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
        plain = len(buf.getvalue())
        sizes: dict[str, list[int]] = {"keyframe": [], "delta": []}
        for info in infos:
            sizes[info.kind].append(info.nbytes)
        last = [i for i in infos if i.kind == "delta"] or infos
        manifest = tw_triton.format.read_manifest(last[-1].path)
        fresh, fresh_opt = build(name, width, 1)
        Checkpointer(d).restore(model=fresh, optimizer=fresh_opt)
    saved = model.state_dict()
    error = max(float((v - saved[k]).norm() / saved[k].norm()) for k, v in fresh.state_dict().items())
    start = saves * every
    losses = {}
    for label, (m, o, order) in {
        "uninterrupted": (model, opt, 0),
        "other_order": (copy.deepcopy(model), None, 1),
        "resumed": (fresh, fresh_opt, 0),
    }.items():
        if o is None:  # the noise floor: the saved state, another data order
            o = getattr(torch.optim, name)(m.parameters(), **OPTIONS.get(name, {}))
            o.load_state_dict(opt.state_dict())
        for i in range(start, start + resume_steps):
            step(m, o, width, i, order)
        losses[label] = held_out(m, width)
    floor = abs(losses["other_order"] - losses["uninterrupted"])
    gap = abs(losses["resumed"] - losses["uninterrupted"])
    return {
        "optimizer": name,
        "options": OPTIONS.get(name, {}),
        "torch_save_bytes": plain,
        "keyframe_ratio": plain / median(sizes["keyframe"]),
        "delta_ratio": plain / median(sizes["delta"]) if sizes["delta"] else None,
        **coded_as(manifest),
        "restored_weight_error": error,
        "losses": losses,
        "gap_over_floor": gap / floor if floor else None,
    }


def markdown(rows: list[dict[str, Any]], cfg: dict[str, Any]) -> str:
    table = []
    for r in rows:
        states = ", ".join(
            f"`{n}` {'/'.join(c)}" for n, c in r["states"].items() if roles.role_of(n) != roles.EXACT
        )
        delta = f"{r['delta_ratio']:.1f}x" if r["delta_ratio"] else "-"
        gap = f"{r['gap_over_floor']:.2f}" if r["gap_over_floor"] is not None else "-"
        bits = codes_label(r.get("weight_codes") or [(b, (1 << (b - 1)) - 1) for b in r["weight_bits"]])
        table.append(
            [
                r["optimizer"],
                states or "exact",
                bits,
                f"{r['keyframe_ratio']:.2f}x",
                delta,
                f"{100 * r['restored_weight_error']:.2f}%",
                gap,
            ]
        )
    head = [
        "optimizer",
        "moments coded as",
        "weight-delta bits",
        "keyframe",
        "delta",
        "restored weights off",
        "resumed gap / floor",
    ]
    return (
        "# Every torch.optim optimizer with the Checkpointer's defaults\n\n"
        f"From `python benchmarks/optimizers.py` ({cfg['params']:,} parameters, {cfg['saves']} saves "
        f"{cfg['every']} steps apart, {cfg['resume_steps']} resumed steps; {machine_description()}); ratios against `torch.save` "
        "of the same state; weight-delta bits are each container, with the largest code `qmax` where "
        "the `max_error` choice keeps fewer levels than it holds (of the last delta); every other "
        "state is exact (Adafactor's factored moments are under the "
        "presets' 4096-element floor; ASGD, L-BFGS and Rprop keep no moment).\n\n"
        + fmt_table(head, table)
        + "\n"
    )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small model and 4 saves (a smoke run)")
    ap.add_argument("--only", help="comma-separated optimizer names")
    ap.add_argument("--out", help="result name (default: optimizers; nothing with --quick)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the steps are small; one thread keeps a shared machine's timings sane
    width, saves, every, resume = (128, 4, 2, 4) if args.quick else (1024, 12, 5, 30)
    names = args.only.split(",") if args.only else sorted(roles.OPTIMIZER_STATES)
    rows = []
    for name in names:
        log(f"{name} ...")
        rows.append(run_one(name, width, saves, every, resume))
    params = sum(p.numel() for p in build("Adam", width, 0)[0].parameters())
    cfg = {"width": width, "params": params, "saves": saves, "every": every, "resume_steps": resume}
    md = markdown(rows, cfg)
    print(md)
    out = args.out or (None if args.quick else "optimizers")
    if out:
        write_result(out, {"config": cfg, "rows": rows})
        (RESULTS_DIR / f"{out}.md").write_text(md, encoding="utf-8")
    return rows


if __name__ == "__main__":
    main()
