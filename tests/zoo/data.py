"""Synthetic batches with something to learn, and the losses that go with them.

Each maker is a pure function of (seed, rows): the same call gives the same tensors in any process.
Every loss is a mean over rows (equal weight per row), the form pipelines and data parallelism must
reproduce from pieces of the batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as F

from .case import Batch, generator

VOCAB = 64
SEQ = 16
CLASSES = 4


def lm_batch(seed: int, rows: int, vocab: int = VOCAB, seq: int = SEQ) -> Batch:
    """Arithmetic token sequences (start + stride * i mod vocab, stride 1..3 per row): the next token is
    predictable from the two before it, so a small decoder learns within a few steps."""
    g = generator(seed)
    start = torch.randint(vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, a mean over every token (rows have equal length, so rows weigh equally)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def hf_lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """The same on a Hugging Face `ModelOutput` (its `.logits`; labels are not passed to the model)."""
    return lm_loss(output.logits, targets)


def image_batch(seed: int, rows: int, size: int = 16, classes: int = CLASSES) -> Batch:
    """Noise images whose class shifts the mean of one colour channel and one quadrant."""
    g = generator(seed)
    labels = torch.randint(classes, (rows,), generator=g)
    images = torch.randn(rows, 3, size, size, generator=g)
    half = size // 2
    for c in range(classes):
        rows_c = labels == c
        images[rows_c, c % 3] += 1.0
        top, left = (c // 2) * half, (c % 2) * half
        images[rows_c, :, top : top + half, left : left + half] += 0.5
    return images, labels


def class_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def hf_class_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    return class_loss(output.logits, labels)


def dict_class_loss(output: dict[str, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
    return class_loss(output["logits"], labels)


def token_class_batch(seed: int, rows: int, vocab: int = VOCAB, seq: int = SEQ, classes: int = 3) -> Batch:
    """Padded token sequences of 4..seq valid tokens; each class draws 3 of 4 tokens from its own band of
    the vocabulary. Inputs are {"input_ids", "mask"} (mask 1.0 on valid tokens, padding id 0)."""
    g = generator(seed)
    labels = torch.randint(classes, (rows,), generator=g)
    band = vocab // classes
    own = labels[:, None] * band + torch.randint(band, (rows, seq), generator=g)
    other = torch.randint(vocab, (rows, seq), generator=g)
    tokens = torch.where(torch.rand(rows, seq, generator=g) < 0.75, own, other)
    lengths = torch.randint(4, seq + 1, (rows, 1), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths).float()
    return {"input_ids": tokens * mask.long(), "mask": mask}, labels


def regression_batch(seed: int, rows: int, features: int = 16, outputs: int = 4) -> Batch:
    """y = a fixed random linear map of tanh(x) plus a little noise (the map is the same for every seed)."""
    teacher = torch.randn(features, outputs, generator=generator(12345)) / features**0.5
    g = generator(seed)
    x = torch.randn(rows, features, generator=g)
    return x, torch.tanh(x) @ teacher + 0.01 * torch.randn(rows, outputs, generator=g)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
