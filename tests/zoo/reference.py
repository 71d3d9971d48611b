"""The reference run: plain PyTorch, one process, the whole global batch per step. Every strategy in
the correctness matrix is checked against what this records. Nothing here imports paratrain, so a bug
shared by the library's own `single` strategy and the strategy under test cannot hide.

    model = case.build(seed); opt = SGD(model.parameters(), ...)
    for step, (x, y) in enumerate(batches):
        model.train(); <dropout rule for this step>
        with torch.autocast(device, bfloat16):      # bf16 only
            out = model(x)
        loss = case.loss_fn(float32(out), y)        # the loss itself in float32
        loss.backward(); opt.step(); opt.zero_grad()
    model.eval(); with no_grad: eval loss and outputs on a held-out batch

Dropout. The default `dropout=torch_rng` seeds torch's global RNG before every step; its masks depend on
the order in which layers and rows draw, so no split layout can reproduce them. The correctness matrix
(tests/test_matrix.py) and the GPU tests (tests/test_gpu.py) therefore compare dropout cases with
`dropout=zoo.dropout_rule.layout_rule`, a reference that restates the library's own mask rule (per layer
path, micro-step, global row and position; docs/parallelism.md, "Randomness") and so draws exactly the
library's masks. Those comparisons check that every layout draws the rule's masks; they cannot catch a flaw
in the rule itself (masks repeated across rows or steps, a wrong rate or scale), which both sides would
share. tests/test_dropout_stats.py checks the library's masks against statistics instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .case import Batch, ZooCase

DropoutRule = Callable[[nn.Module, int, int], None]
"""rule(model, seed, step): prepares the dropout masks of one training step (see the module docstring)."""

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
DEFAULT_SIZES = (8, 8, 5)
"""Rows of the global batches of a run: two full ones and a short last one (an epoch's tail)."""


def torch_rng(model: nn.Module, seed: int, step: int) -> None:
    """Today's rule: torch's global RNG, seeded per step."""
    torch.manual_seed(seed * 100_003 + step)


@dataclass(frozen=True, kw_only=True)
class Optim:
    """The optimizer, as settings (both sides of a comparison build their own from these)."""

    name: str = "sgd"
    lr: float | None = None
    """None: the case's own learning rate."""
    momentum: float = 0.9
    weight_decay: float = 0.0

    def make(self, params: Any, case: ZooCase) -> torch.optim.Optimizer:
        lr = self.lr if self.lr is not None else case.lr
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=self.momentum, weight_decay=self.weight_decay)
        if self.name == "adamw":
            return torch.optim.AdamW(params, lr=lr, weight_decay=self.weight_decay)
        raise ValueError(f"optimizer {self.name!r}: use 'sgd' or 'adamw'")


@dataclass
class Record:
    """What a run did, step by step (all tensors detached CPU copies)."""

    losses: list[float] = field(default_factory=list)
    """The global-batch loss of every step."""
    initial: dict[str, torch.Tensor] = field(default_factory=dict)
    """state_dict before training."""
    first_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """Gradients after the first backward, by every parameter name (a tied weight under both names)."""
    weights: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """state_dict after every optimizer step (parameters and buffers)."""
    grad_norms: list[float] = field(default_factory=list)
    """With clipping: the whole gradient's norm before it, every step (so a test can see that it clipped)."""
    eval_loss: float | None = None
    eval_outputs: Any = None
    """model.eval() outputs on the evaluation batch: float32 tensors (a ModelOutput becomes a plain dict)."""


def global_batches(case: ZooCase, seed: int = 0, sizes: Sequence[int] = DEFAULT_SIZES) -> list[Batch]:
    return [case.batch(seed * 1000 + i, rows) for i, rows in enumerate(sizes)]


def eval_batch(case: ZooCase, seed: int = 0, rows: int = 6) -> Batch:
    """A held-out batch, of another size than the training ones (a validation batch usually is)."""
    return case.batch(seed * 1000 + 999, rows)


def to_float32(value: Any) -> Any:
    """Outputs cast to float32 (tensors inside tuples, lists, dicts and Hugging Face ModelOutputs)."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() else value
    if isinstance(value, dict):
        return type(value)(**{k: to_float32(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return type(value)(to_float32(v) for v in value)
    return value


def to_device(value: Any, device: torch.device | str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_device(v, device) for v in value)
    return value


def tensors_of(value: Any) -> Any:
    """The tensors of an output, detached on the CPU, in plain dicts, lists and tuples (anything else, such
    as a Hugging Face cache object, is dropped)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        kept = {k: tensors_of(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not None}
    if isinstance(value, list | tuple):
        return type(value)(tensors_of(v) for v in value)
    return None


def rows(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0])
    if isinstance(value, dict):
        return rows(next(iter(value.values())))
    return rows(value[0])


def chunk(value: Any, parts: int) -> list[Any]:
    """`parts` contiguous pieces along dim 0 (sizes differ by at most one row)."""
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, parts))
    if isinstance(value, dict):
        pieces = {k: chunk(v, parts) for k, v in value.items()}
        return [{k: p[i] for k, p in pieces.items()} for i in range(parts)]
    pieces_seq = [chunk(v, parts) for v in value]
    return [type(value)(p[i] for p in pieces_seq) for i in range(parts)]


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def run_reference(case: ZooCase, batches: Sequence[Batch], *, seed: int = 0, optim: Optim = Optim(),
                  precision: str = "fp32", device: str = "cpu", evaluate: Batch | None = None,
                  accumulate: int = 1, dropout: DropoutRule = torch_rng, clip: float | None = None,
                  frozen: Callable[[str], bool] | None = None,
                  lr_factor: Callable[[int], float] | None = None) -> Record:
    """Train `case` on `batches` (one optimizer step each) and record every step; see the module docstring.

    accumulate=k runs each batch as k contiguous micro-batches whose losses are weighted by their rows
    (exactly the full-batch mean loss): the legitimate reordering of sums any split makes, used by the
    zoo tests to measure how far an exact strategy may drift in each precision. It changes results by
    construction for BatchNorm and dropout cases. clip=c clips the gradients by their norm before every
    step (torch.nn.utils.clip_grad_norm_), as most language-model loops do. frozen(name) true: that parameter
    is frozen (requires_grad False, left out of the optimizer); lr_factor: a LambdaLR schedule stepped after
    every optimizer step (a warm-up, say).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: use one of {sorted(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    device_type = torch.device(device).type
    model = case.build(seed).to(device)
    for name, param in model.named_parameters():
        if frozen is not None and frozen(name):
            param.requires_grad_(False)
    opt = optim.make([p for p in model.parameters() if p.requires_grad], case)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor) if lr_factor is not None else None
    record = Record(initial=snapshot(model))

    def forward(inputs: Any) -> Any:
        if dtype is None:
            return model(inputs)
        with torch.autocast(device_type=device_type, dtype=dtype):
            return to_float32(model(inputs))

    for step, (inputs, targets) in enumerate(batches):
        inputs, targets = to_device(inputs, device), to_device(targets, device)
        model.train()
        dropout(model, seed, step)
        total, loss_sum = rows(inputs), 0.0
        for xs, ys in zip(chunk(inputs, accumulate), chunk(targets, accumulate)):
            loss = case.loss_fn(forward(xs), ys) * (rows(xs) / total)
            loss.backward()
            loss_sum += loss.item()
        record.losses.append(loss_sum if accumulate > 1 else loss.item())
        if step == 0:
            record.first_grads = {n: p.grad.detach().cpu().clone()
                                  for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
        if clip is not None:
            record.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()
        record.weights.append(snapshot(model))
    if evaluate is not None:
        model.eval()
        inputs, targets = to_device(evaluate[0], device), to_device(evaluate[1], device)
        with torch.no_grad():
            out = forward(inputs)
            record.eval_loss = case.loss_fn(out, targets).item()
        record.eval_outputs = tensors_of(to_float32(out))
    return record
