"""A loop that accumulates the way DDP loops do, calling run.forward_backward several times before the optimizer
steps (no accumulation window: grad_accum=1), under pipelines whose head is tied to the embedding on another
rank. Each call sums the tied copies' gradients over their holders; summing again after the next backward
would count the first one twice. The gradients before every step must be the one-process sums, whether the loop
clears them with set_to_none (new tensors), in place (set_to_none=False) or not at all."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import zoo
from zoo.reference import global_batches

import paratrain

WINDOWS = ((8, 8), (8,), (8, 8))
"""Rows of the batches of each optimizer step: two forward_backward calls, then one, then two."""
CLEAR = (False, True)
"""How the gradients are cleared after the first and the second step: in place, then set to None."""


def _windows(case: Any) -> list[list[tuple[Any, Any]]]:
    batches = global_batches(case, 0, tuple(rows for window in WINDOWS for rows in window))
    out, at = [], 0
    for window in WINDOWS:
        out.append(batches[at : at + len(window)])
        at += len(window)
    return out


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.grad is not None:
            whole = getattr(p.grad, "full_tensor", None)
            out[name] = (whole() if whole is not None else p.grad).detach().clone()
    return out


def _train(strategy: str) -> list[dict[str, torch.Tensor]]:
    case = zoo.MODELS["tied_seq"]
    run = paratrain.setup(strategy=strategy, schedule="1f1b", microbatches=2, balance="equal", seed=0,
                          timeout_s=60, accelerator="cpu")
    try:
        model = case.build(0)
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        seen = []
        for i, window in enumerate(_windows(case)):
            for inputs, targets in window:
                run.forward_backward(model, inputs, targets, case.loss_fn)
            seen.append(_grads(run.unwrap(model)))
            optimizer.step()
            if i < len(CLEAR):
                optimizer.zero_grad(set_to_none=CLEAR[i])
        return seen
    finally:
        run.close()


def _plain() -> list[dict[str, torch.Tensor]]:
    case = zoo.MODELS["tied_seq"]
    model = case.build(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for i, window in enumerate(_windows(case)):
        for inputs, targets in window:
            case.loss_fn(model(inputs), targets).backward()
        seen.append(_grads(model))
        optimizer.step()
        if i < len(CLEAR):
            optimizer.zero_grad(set_to_none=CLEAR[i])
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("strategy", "nproc"), [("pp", 2), ("ddp+pp", 4), ("fsdp+pp", 4)])
def test_repeated_forward_backward_sums_tied_gradients_once(strategy: str, nproc: int) -> None:
    want = _plain()
    per_rank = paratrain.launch(_train, strategy, nproc=nproc, timeout=150, all_ranks=True, accelerator="cpu")
    tied = {"0.weight", "5.weight"}  # the embedding and the head: one Parameter, held on both pipeline ranks
    assert tied <= {name for windows in per_rank for name in windows[0]}
    for rank, windows in enumerate(per_rank):
        for step, (got, expected) in enumerate(zip(windows, want)):
            for name, grad in got.items():
                diff = float((grad - expected[name]).abs().max())
                assert diff <= 1e-6 * float(expected[name].abs().max()) + 1e-8, (
                    f"rank {rank}, step {step}: {name} off by {diff:.3g} (of {float(expected[name].abs().max()):.3g})")
