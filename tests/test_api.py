"""The Run's own surface (one process): batch arithmetic, evaluation that trains nothing and restores the
mode, the step counter that evaluation leaves alone, and `prepare`'s refusal to split without an example."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))


def test_per_worker_batch_names_the_arithmetic() -> None:
    run = paratrain.setup(strategy="single", grad_accum=3)
    assert run.per_worker_batch(12) == 4
    with pytest.raises(paratrain.ParatrainError, match=r"global batch 10 .* 3 parts.*e\.g\. 9"):
        run.per_worker_batch(10)
    run.close()


def test_strategy_auto_says_what_it_chose(capsys: pytest.CaptureFixture[str]) -> None:
    """One process: `single`, said at setup (several: tests/test_auto_strategy.py)."""
    run = paratrain.setup()
    assert run.strategy.name == "single"
    run.close()
    lines = [line for line in capsys.readouterr().out.splitlines() if "strategy auto" in line]
    assert lines == ["paratrain: strategy auto -> single (1 process)"]
    paratrain.setup(strategy="single").close()
    assert "strategy auto" not in capsys.readouterr().out


def test_evaluate_trains_nothing_counts_no_step_and_restores_the_mode() -> None:
    torch.manual_seed(0)
    run = paratrain.setup(strategy="single")
    model, optimizer = run.prepare(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    first = run.evaluate(model, x, y, nn.functional.mse_loss)
    with torch.no_grad():
        second = run.forward_backward(model, x, y, nn.functional.mse_loss)  # under no_grad: evaluation
    assert model.training  # the caller's mode is back
    assert float(first) == float(second)  # eval mode: dropout off, so the same loss twice
    with torch.no_grad():
        want = nn.functional.mse_loss(model.eval()(x), y)
    assert float(first) == pytest.approx(float(want), abs=1e-7)
    assert run.step.count == 0 and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    outputs = run.evaluate(model, x)  # no loss function: the outputs
    assert outputs.shape == (6, 2)
    run.forward_backward(model.train(), x, y, nn.functional.mse_loss)
    optimizer.step()
    assert run.step.count == 1 and run.sync_step
    run.close()


def test_a_pipeline_without_an_example_is_told_what_to_pass() -> None:
    run = paratrain.setup(strategy="mp")  # balance="time" measures layers: it needs a batch
    with pytest.raises(paratrain.ParatrainError, match=r"example=inputs"):
        run.prepare(_model())
    run.close()


def _dropout_losses(run: paratrain.Run, steps: int, between: object = None) -> list[float]:
    torch.manual_seed(0)
    model = _model()
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    losses = []
    for _ in range(steps):
        losses.append(float(run.forward_backward(model, x, y, nn.functional.mse_loss)))
        optimizer.step()
        optimizer.zero_grad()
        if callable(between):
            between()
    return losses


def test_two_runs_in_one_process_keep_their_own_micro_step_state() -> None:
    """Dropout masks follow a run's own seed and micro-step (parallel/step_state.py): another run stepping in
    between, with another seed and its own count, changes nothing of the first run's."""
    alone = paratrain.setup(strategy="single", seed=0)
    want = _dropout_losses(alone, 4)
    alone.close()
    first = paratrain.setup(strategy="single", seed=0)
    other = paratrain.setup(strategy="single", seed=7)
    torch.manual_seed(1)
    model = other.prepare(_model())
    x, y = torch.randn(5, 4), torch.randn(5, 2)

    def other_steps() -> None:
        for _ in range(3):
            other.forward_backward(model, x, y, nn.functional.mse_loss)

    got = _dropout_losses(first, 4, between=other_steps)
    assert got == want  # bit for bit
    assert len(set(got)) == len(got) and other.step.count == 12 and first.step.count == 4
    other.close()  # the later run first, so each puts back the SIGTERM handler it found
    first.close()
