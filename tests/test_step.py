"""The micro-step (`paratrain.step`): counting, the accumulation window, gradient sync armed before the
user's forward, and an optimizer that steps only at window ends."""

from __future__ import annotations

import torch
from torch import nn

import paratrain
from paratrain.step import PreparedOptimizer, Step, rebind


def _recorder() -> tuple[list[tuple[str, bool]], Step]:
    calls: list[tuple[str, bool]] = []
    step = Step(3, lambda model, sync: calls.append((type(model).__name__, sync)))
    return calls, step


def test_window_of_three_syncs_only_on_its_last_micro_step() -> None:
    calls, step = _recorder()
    model = nn.Linear(2, 2)
    step.track(model)
    assert calls == [("Linear", False)]  # armed for micro-step 0 before any forward
    seen = []
    for _ in range(6):
        with step.micro(model):
            seen.append((step.count, step.syncs, calls[-1][1]))
    # inside each micro-step the flag in force is the one that micro-step needs
    assert seen == [(0, False, False), (1, False, False), (2, True, True),
                    (3, False, False), (4, False, False), (5, True, True)]
    assert step.count == 6 and step.at_boundary
    assert calls[-1] == ("Linear", False)  # armed again for the next window's first micro-step


def test_restore_rearms_the_flag_for_the_micro_step_that_follows() -> None:
    calls, step = _recorder()
    step.track(nn.Linear(1, 1))
    step.restore(2)
    assert step.count == 2 and calls[-1] == ("Linear", True)


def test_prepared_optimizer_steps_and_zeroes_only_at_window_ends() -> None:
    _, step = _recorder()
    p = nn.Parameter(torch.ones(1))
    opt = PreparedOptimizer(torch.optim.SGD([p], lr=1.0), step, None)
    p.grad = torch.ones(1)
    opt.step()  # nothing counted yet
    assert p.item() == 1.0
    for expected in (1.0, 1.0, 0.0):
        with step.micro():
            pass
        opt.step()
        opt.zero_grad()
        assert p.item() == expected
    assert p.grad is None  # zeroed at the window's end only
    assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups[0]["lr"] == 1.0


def test_rebind_points_the_optimizer_at_the_new_parameters_by_name() -> None:
    old = nn.Linear(2, 2)
    new = nn.Linear(2, 2)
    opt = torch.optim.Adam(old.parameters())
    old.weight.grad = torch.ones(2, 2)
    opt.step()
    rebind(opt, dict(old.named_parameters()), {"weight": new.weight})  # bias not held here
    assert opt.param_groups[0]["params"] == [new.weight]
    assert list(opt.state) == [new.weight] and "exp_avg" in opt.state[new.weight]


def test_ddp_backward_syncs_on_the_window_end_only() -> None:
    """The flag DDP reads in forward is already right when the user's own `model(x)` runs."""
    run = paratrain.setup(strategy="ddp", grad_accum=2)
    model = run.prepare(nn.Linear(3, 1))
    flags = []
    for _ in range(4):
        flags.append(model.require_backward_grad_sync)
        run.backward(model(torch.ones(2, 3)).sum())
    assert flags == [False, True, False, True]
    assert run.sync_step
    run.close()


def test_a_flag_that_does_not_change_is_not_set_again() -> None:
    calls: list[bool] = []
    step = Step(1, lambda model, sync: calls.append(sync))  # no accumulation: every micro-step syncs
    model = nn.Linear(1, 1)
    step.track(model)
    for _ in range(5):
        with step.micro(model):
            pass
    assert calls == [True]  # armed once; nothing to do per micro-step
