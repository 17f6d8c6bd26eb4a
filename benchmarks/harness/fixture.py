"""The training state of the speed comparison: all-MiniLM-L6-v2 + AdamW after one real step.

:func:`build_fixture` writes it with ``torch.save`` once for the measuring children to read;
:func:`flatten`, :func:`empty_like_tree` and :func:`perturb` are what the save and load
methods do to it. Needs the ``bench`` extra for the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def build_fixture(path: Path) -> dict[str, Any]:
    """MiniLM + AdamW after one real step, saved with torch.save for the children to read."""
    from harness.minilm import SENTENCES, contrastive_step, load_minilm

    model, tokenizer = load_minilm()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    half = len(SENTENCES) // 2
    # Neighbouring sentences are paraphrases: (0, 1), (2, 3), ... are the positive pairs.
    contrastive_step(model, tokenizer, opt, list(SENTENCES[0::2][:half]), list(SENTENCES[1::2][:half]))
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(state, path)
    tensors = [v for v in flatten(state).values()]
    return {
        "params": sum(v.numel() for v in state["model"].values()),
        "state_tensors": len(tensors),
        "state_bytes": sum(v.numel() * v.element_size() for v in tensors),
    }


def flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a nested dict by ``a/b/c`` path (other leaves left out)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}/"))
    elif isinstance(tree, torch.Tensor):
        out[prefix[:-1]] = tree
    return out


def non_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """What safetensors cannot hold as tensors: the optimizer's param_groups."""
    return {"param_groups": state["optimizer"]["param_groups"]}


def empty_like_tree(tree: Any) -> Any:
    """The same tree with every tensor replaced by an uninitialised one of its shape."""
    if isinstance(tree, dict):
        return {k: empty_like_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [empty_like_tree(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    return tree


def perturb(state: dict[str, Any]) -> None:
    """Move the weights a little, like a few training steps, so a delta is not all zeros."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for v in state["model"].values():
            if v.is_floating_point():
                v.add_((torch.randn(v.shape, generator=gen) * 1e-4).to(v.device))
