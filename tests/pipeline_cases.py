"""Shared cases for the model- and pipeline-parallel tests: one model, fixed batches, the single-process
reference, and the same training loop run under any strategy (what a user script does)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import paratrain

LR = 0.1
TOL = 1e-6
"""float32 losses and weights agree with the single-process run to 1e-6 absolute (observed ~1e-7: the
micro-batch means and replica averages sum the same numbers in another order)."""


class Flatten2(nn.Module):
    """Not an nn.Sequential (a reshape sits between children), so it is split by tracing."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.body(self.inp(x)), 1))


def make_model(kind: str = "seq") -> nn.Module:
    if kind == "traced":
        return Flatten2()
    inplace = kind == "inplace"  # a stage may start with an in-place layer (it gets a leaf as input)
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(inplace=inplace), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32),
        nn.ReLU(inplace=inplace), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4),
    )


def batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)) for _ in range(steps)]


def reference(steps: int = 3, batch: int = 16, kind: str = "seq") -> dict[str, Any]:
    """Plain PyTorch, one process, full batch: what every strategy must reproduce."""
    torch.manual_seed(0)
    model = make_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in batches(steps, batch):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def train(strategy: str, steps: int = 3, batch: int = 16, kind: str = "seq", grad_accum: int = 1,
          save_to: str | None = None, resume_from: str | None = None, **options: Any) -> dict[str, Any]:
    """The user loop under `strategy`; returns losses, this rank's weights (original names) and the plan."""
    run = paratrain.setup(strategy=strategy, seed=0, grad_accum=grad_accum, **options)
    replica, replicas = run.strategy.data_shard(run.ctx)
    share = batch // replicas
    shares = [(x[replica * share : (replica + 1) * share], y[replica * share : (replica + 1) * share])
              for x, y in batches(steps, batch)]
    model = make_model(kind)
    example = shares[0][0].chunk(grad_accum)[0].to(run.device)  # one micro-step's inputs
    model, opt = run.prepare(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), example=example)
    state = {"model": model, "optimizer": opt}
    first = 0
    if resume_from:
        run.load(state, path=resume_from)
        first = int(state.get("step", 0))
    losses = []
    for step, (x, y) in enumerate(shares):
        if step < first:
            continue
        micro = []
        for xs, ys in zip(x.chunk(grad_accum), y.chunk(grad_accum)):
            xs, ys = xs.to(run.device), ys.to(run.device)
            micro.append(run.forward_backward(model, xs, ys, nn.functional.mse_loss).item())
        opt.step()
        opt.zero_grad()
        losses.append(sum(micro) / len(micro))
        if save_to and step == 1:
            state["step"] = step + 1
            run.save(state, path=save_to)
            run.wait_for_save()  # the caller lists the checkpoint's files next; the write runs in the background
    weights = {k: v.detach().cpu().clone() for k, v in run.unwrap(model).state_dict().items()}
    plan = getattr(model, "plan", None)
    tuning = getattr(model, "ddp_tuning", None)  # comm_hook="auto": what was measured and chosen
    logged = getattr(model, "_get_ddp_logging_data", None)  # what DDP says it was built with
    return {"losses": losses, "weights": weights, "plan": plan.as_dict() if plan else None,
            "rank": run.rank, "replica": replica, "tuning": vars(tuning) if tuning else None,
            "ddp": {k: v for k, v in logged().items() if isinstance(v, int | str)} if logged else None}


def weight_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest difference over the weights this rank holds (all of them must exist in the reference). A
    stage may hold only stateless layers (an activation), so callers check coverage separately."""
    assert set(got) <= set(want), sorted(set(got) - set(want))
    return max((float((got[k].float() - want[k].float()).abs().max()) for k in got), default=0.0)


def caught(fn: Any, *args: Any, **kwargs: Any) -> str:
    """The message of the ParatrainError `fn` raises (the test fails if it raises nothing)."""
    try:
        fn(*args, **kwargs)
    except paratrain.ParatrainError as exc:
        return str(exc)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} raised no ParatrainError")
