"""What one zoo entry is: a model built from a seed, a batch maker, a loss, and the tolerances a strategy
must meet against the plain-PyTorch reference run of it (`zoo.reference`).

Everything is a function of the seed, never of the global RNG state, so a test (or a worker process of a
distributed test) rebuilds exactly the model and batches the reference used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Batch = tuple[Any, Any]
"""(inputs, targets): inputs is what `model(inputs)` takes (a tensor, a dict of tensors, ...)."""

# Tags say which layout a case exercises; the correctness matrix selects and reports cells by them.
TIED = "tied"  # a parameter shared by two modules (an LM head tied to the token embedding)
MODULELIST = "modulelist"  # blocks held in an nn.ModuleList and iterated in forward
DROPOUT = "dropout"  # dropout with p > 0 in training mode: results depend on how masks are drawn
BATCHNORM = "batchnorm"  # batch statistics: results depend on which rows are normalized together
DICT_IO = "dict_io"  # the model takes and/or returns a dict of tensors
TUPLE_IO = "tuple_io"  # layers pass tuples to each other
BATCH_SHAPE = "batch_shape"  # forward reshapes with the batch size (x.view(b, t, h, d))
TRACED = "traced"  # not an nn.Sequential: a pipeline must trace it to split it
HF = "hf"  # a Hugging Face transformers model (ModelOutput, keyword arguments)
SLOW = "slow"  # seconds per cell rather than milliseconds: tests mark it @pytest.mark.slow
ADAPTERS = "adapters"  # parameter-efficient fine-tuning: the base weights frozen, only adapters (LoRA) train
TAGS = frozenset({TIED, MODULELIST, DROPOUT, BATCHNORM, DICT_IO, TUPLE_IO, BATCH_SHAPE, TRACED, HF, SLOW, ADAPTERS})


@dataclass(frozen=True)
class Tolerance:
    """How far a strategy's run may be from the reference at every step."""

    loss: float
    """Largest absolute difference of a step's loss."""
    atol: float
    rtol: float
    """A state_dict entry matches when max|got - want| <= atol + rtol * max|want - initial|: relative to how
    far training moved it, so a tensor left untrained (its error is its whole update) fails unless its
    update is below atol / (1 - rtol). Buffers (BatchNorm running statistics) are compared the same way."""


@dataclass(frozen=True, kw_only=True)
class ZooCase:
    """One model of the zoo and how to train it."""

    name: str
    about: str
    """What the case exercises, in one sentence (shown by the matrix for refused cells)."""
    build: Callable[[int], nn.Module]
    """build(seed) -> the model, bit-identical for the same seed, whatever the global RNG state."""
    batch: Callable[[int, int], Batch]
    """batch(seed, rows) -> (inputs, targets) with `rows` samples along dim 0."""
    loss_fn: Callable[[Any, Any], torch.Tensor]
    """loss_fn(outputs, targets) -> a scalar mean over the batch (rows weigh equally)."""
    tolerances: Mapping[str, Tolerance]
    """Per precision ("fp32", "bf16"), each above the drift that exact reorderings of sums cause in that
    precision. A bf16 tolerance cannot tell bf16 from float32 (two bf16 runs drift as far apart as bf16 and
    float32 do), so bf16 runs are also checked against `compare.AUTOCAST_FLOOR`."""
    tags: frozenset[str] = field(default_factory=frozenset)
    lr: float = 0.05
    """SGD learning rate at which the case trains visibly in a few steps."""

    def __post_init__(self) -> None:
        unknown = self.tags - TAGS
        if unknown:
            raise ValueError(f"{self.name}: unknown tags {sorted(unknown)}; known: {sorted(TAGS)}")
        if set(self.tolerances) != {"fp32", "bf16"}:
            raise ValueError(f"{self.name}: give tolerances for 'fp32' and 'bf16', got {sorted(self.tolerances)}")

    def has(self, *tags: str) -> bool:
        return all(t in self.tags for t in tags)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a model constructor under `seed` without touching the caller's RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
