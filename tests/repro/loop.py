"""The user's training loop on a zoo case under any strategy, as a script writes it with today's public
API; the reproductions compare what it records with the plain-PyTorch reference (`zoo.reference`).

`prepare` is the one place that calls `run.prepare`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import zoo
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from zoo.reference import Optim, chunk, global_batches, to_device

import paratrain

FAST = {"timeout_s": 60}
"""setup() options every reproduction uses: a hang fails in a minute, not ten."""

After = Callable[[paratrain.Run, nn.Module, torch.optim.Optimizer], dict[str, Any]]
"""Runs after training, before the run closes (an evaluation, a check); its dict joins the result."""


def prepare(run: paratrain.Run, model: nn.Module, optimizer: torch.optim.Optimizer, example: Any) -> Any:
    """run.prepare(model, optimizer, example=...): `example` is a batch of inputs (pipelines trace and measure
    with it)."""
    return run.prepare(model, optimizer, example=example)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict copies, whole tensors even where FSDP keeps DTensor shards."""
    out = {}
    for key, value in model.state_dict().items():
        whole = getattr(value, "full_tensor", None)
        out[key] = (whole() if whole is not None else value).detach().cpu().clone()
    return out


def share(value: Any, run: paratrain.Run) -> Any:
    """This data-parallel rank's contiguous share of a global batch (sizes differ by at most one row)."""
    return chunk(value, run.world_size)[run.rank]


def step(run: paratrain.Run, model: nn.Module, optimizer: torch.optim.Optimizer, case: zoo.ZooCase,
         inputs: Any, targets: Any, form: str) -> float:
    """One optimizer step; form="backward" writes it as loss_fn(model(x), y) + run.backward(loss)."""
    inputs, targets = to_device(inputs, run.device), to_device(targets, run.device)
    if form == "forward_backward":
        loss = run.forward_backward(model, inputs, targets, case.loss_fn)
    else:
        loss = case.loss_fn(model(inputs), targets)
        run.backward(loss)
        loss = run.all_reduce(loss.detach(), "mean")
    optimizer.step()
    optimizer.zero_grad()
    return float(loss)


def train(case: zoo.ZooCase | str, strategy: str, sizes: Sequence[int] = (8, 8), *, seed: int = 0,
          sharded: bool = False, form: str = "forward_backward", after: After | None = None,
          **options: Any) -> dict[str, Any]:
    """Train `case` one step per global batch of `sizes` rows; returns per-step losses and this rank's
    weights. sharded=True gives each rank its share of every batch (data-parallel strategies)."""
    case = zoo.MODELS[case] if isinstance(case, str) else case
    run = paratrain.setup(strategy=strategy, seed=seed, **{**FAST, **options})
    batches = global_batches(case, seed, sizes)
    model = case.build(seed)
    model, optimizer = prepare(run, model, Optim().make(model.parameters(), case), example=batches[0][0])
    losses, weights = [], []
    for inputs, targets in batches:
        if sharded:
            inputs, targets = share(inputs, run), share(targets, run)
        losses.append(step(run, model, optimizer, case, inputs, targets, form))
        weights.append(full_state(run.unwrap(model)))
    result = {"losses": losses, "weights": weights, "rank": run.rank}
    if after is not None:
        result.update(after(run, model, optimizer))
    run.close()
    return result


def train_epochs(case_name: str, strategy: str, samples: int, global_batch: int, epochs: int, *, seed: int = 0,
                 **options: Any) -> dict[str, Any]:
    """Train on a dataset of `samples` rows through `run.prepare_loader(DataLoader(shuffle=True))`; also
    returns which dataset rows this rank got at every step, so the reference can replay the global batches."""
    case = zoo.MODELS[case_name]
    run = paratrain.setup(strategy=strategy, seed=seed, **{**FAST, **options})
    inputs, targets = case.batch(seed, samples)
    data = TensorDataset(torch.arange(samples), inputs, targets)
    loader = run.prepare_loader(DataLoader(data, batch_size=run.per_worker_batch(global_batch), shuffle=True))
    model = case.build(seed)
    model, optimizer = prepare(run, model, Optim().make(model.parameters(), case), example=inputs[:1])
    losses, weights, rows = [], [], []
    for _ in range(epochs):
        for index, x, y in loader:
            rows.append(index.tolist())
            losses.append(step(run, model, optimizer, case, x, y, "forward_backward"))
            weights.append(full_state(run.unwrap(model)))
    run.close()
    return {"losses": losses, "weights": weights, "rows": rows, "rank": run.rank}
