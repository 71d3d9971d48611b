"""`run.log`, the progress bar and the step breakdown on one process: what is written (metrics.jsonl,
TensorBoard events, the bar), how a resumed run continues its logs, what is refused, and that a run
which neither logs nor profiles gets no timers, hooks or files."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.observe.breakdown import RankTimes, describe, slow_ranks
from paratrain.observe.sinks import JsonLines, default_log_dir


def _times(busy: float, comm: float = 0.0, data: float = 0.0) -> RankTimes:
    return RankTimes(data=data, compute=busy - data, comm=comm, optimizer=0.0, other=0.001)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _train(run: paratrain.Run, steps: range, state: dict[str, Any] | None = None, **log: Any) -> list[dict]:
    """A few steps of a linear model on 8-sample batches, logging each; returns the records."""
    data = TensorDataset(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)), torch.randn(64, 1))
    loader = run.prepare_loader(DataLoader(data, batch_size=8, shuffle=True))
    model = nn.Linear(4, 1)
    model, opt = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if state is not None:
        state.update(model=model, optimizer=opt, loader=loader)
        run.load(state)
    records = []
    batches = iter(loader)
    for step in steps:
        x, y = next(batches)
        loss = nn.functional.mse_loss(model(x), y)
        run.backward(loss)
        opt.step()
        opt.zero_grad()
        records.append(run.log(step, loss=loss, **log))
        if state is not None:
            state["step"] = step
    return records


# -- tier 1: pure logic ----------------------------------------------------------------------------


def test_a_rank_is_slow_against_the_median_of_the_others_and_the_phase_it_loses_in_is_named() -> None:
    assert slow_ranks([_times(0.010, comm=0.02), _times(0.030, data=0.021)]) == [1]  # two ranks: the other one
    assert slow_ranks([_times(0.010), _times(0.011), _times(0.030, data=0.02), _times(0.009)]) == [2]
    assert slow_ranks([_times(0.010), _times(0.014), _times(0.012)]) == []  # within 1.5x: noise, not a slow rank
    assert slow_ranks([_times(0.010)]) == []
    text = describe(1, [_times(0.010), _times(0.030, data=0.021)])
    assert text.startswith("rank 1 is slow") and "its data takes 21.0 ms" in text and "loader" in text


def test_jsonl_of_a_resumed_run_drops_the_steps_it_repeats_and_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in range(1, 8)) + '{"step": 8, "lo')
    sink = JsonLines(path, first_step=5)  # resumed from the checkpoint of step 4
    sink.write({"step": 5, "loss": 0.0})
    assert [r["step"] for r in _lines(path)] == [1, 2, 3, 4, 5] and _lines(path)[-1]["loss"] == 0.0
    sink.close()


def test_default_log_dir_is_beside_the_checkpoints_or_a_new_dated_folder(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_log_dir("ckpt") == Path("ckpt/logs")
    monkeypatch.chdir(tmp_path)
    first = default_log_dir(None, now=0.0)
    assert first.parent == Path("runs") and len(first.name) == len("19700101-000000")
    first.mkdir(parents=True)
    assert default_log_dir(None, now=0.0) == Path(f"{first}-2")  # never appended to another run's logs


def test_bad_logging_options_are_refused_with_the_fix() -> None:
    with pytest.raises(paratrain.ParatrainError, match="log_dir must be"):
        paratrain.setup(log_dir="")
    with pytest.raises(paratrain.ParatrainError, match="progress must be True, False or None"):
        paratrain.setup(progress="yes")
    with pytest.raises(paratrain.ParatrainError, match="profile must be True or False"):
        paratrain.setup(profile=1)


# -- tier 2: one process ---------------------------------------------------------------------------


def test_log_writes_json_lines_tensorboard_and_the_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = paratrain.setup(strategy="single", log_dir=str(tmp_path / "logs"), progress=True)
    records = _train(run, range(1, 5), total_steps=4)
    run.log(4, {"val/accuracy": 0.5})
    run.print("after the bar")
    run.close()
    lines = _lines(tmp_path / "logs" / "metrics.jsonl")
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 4] and lines[:4] == records
    assert all(r["loss"] > 0 and r["samples_per_s"] > 0 and r["step_time_s"] > 0 for r in records)
    assert lines[-1]["val/accuracy"] == 0.5 and "step_time_s" not in lines[-1]  # no step passed since the last log
    assert "data_s" not in lines[0] and "per_rank" not in lines[0]  # the breakdown only while profiling
    scalars = _scalars(tmp_path / "logs")
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3, 4]
    assert scalars["loss"][2][1] == pytest.approx(lines[2]["loss"], rel=1e-6)
    assert "perf/samples_per_s" in scalars and scalars["val/accuracy"] == [(4, 0.5)]
    out = capsys.readouterr()
    assert "4/4" in out.err and "loss=" in out.err and "samples/s=" in out.err and "step=" in out.err
    assert "after the bar" in out.out


def test_a_run_that_does_not_log_or_profile_times_nothing_and_writes_nothing(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = paratrain.setup(strategy="single", checkpoint_dir="ckpt")
    calls = []
    monkeypatch.setattr("paratrain.observe.breakdown.Breakdown._now", lambda self: calls.append(1) or 0.0)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    loader = run.prepare_loader(DataLoader(data, batch_size=4))
    model = nn.Linear(4, 1)
    model, opt = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in loader:
        run.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
    run.all_reduce(1.0)
    assert calls == [] and run.timing._handles == [] and not any(run.timing.totals.values())
    assert run.log_dir == Path("ckpt/logs") and not (tmp_path / "ckpt").exists() and not (tmp_path / "runs").exists()
    run.close()


def test_resumed_run_continues_the_same_logs(tmp_path: Path) -> None:
    first = paratrain.setup(strategy="single", checkpoint_dir=str(tmp_path), progress=False)
    state: dict[str, Any] = {"step": 0}
    _train(first, range(1, 5), state)
    first.save(state)  # the checkpoint of step 4
    _train(first, range(5, 8))  # logged, then lost: the run dies before the next checkpoint
    first.close()
    second = paratrain.setup(strategy="single", checkpoint_dir=str(tmp_path), progress=False)
    state = {"step": 0}
    records = _train(second, range(5, 9), state)
    second.close()
    assert state["step"] == 8 and records[0]["step"] == 5 and records[0]["step_time_s"] > 0
    assert [r["step"] for r in _lines(tmp_path / "logs" / "metrics.jsonl")] == list(range(1, 9))
    assert [s for s, _ in _scalars(tmp_path / "logs")["loss"]] == list(range(1, 9))  # TensorBoard purged 5-7 too


def test_without_tensorboard_json_lines_are_written_and_the_install_is_named_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    run = paratrain.setup(strategy="single", log_dir=str(tmp_path), progress=False)
    _train(run, range(1, 4))
    run.close()
    assert capsys.readouterr().err.count("pip install 'paratrain[tensorboard]'") == 1
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"] and len(_lines(tmp_path / "metrics.jsonl")) == 3


def test_log_refuses_what_it_cannot_average(tmp_path: Path) -> None:
    run = paratrain.setup(strategy="single", log_dir=str(tmp_path), progress=False)
    cases = [({"time": 1.0}, "writes itself"), ({"x": torch.ones(3)}, r"shape \(3,\).*x.mean\(\)"),
             ({"x": "high"}, "not a number"), ({"x": 1.0, "reduce": "max"}, "use 'mean' or 'sum'"),
             ({"x": 1.0, "reduce": {"y": "sum"}}, "not logged in this call")]
    for kwargs, message in cases:
        with pytest.raises(paratrain.ParatrainError, match=message):
            run.log(1, **kwargs)
    assert run.log(1, x=torch.tensor([2.0]), n=3)["n"] == 3.0
    run.close()


def test_profile_times_each_phase_of_the_step(tmp_path: Path) -> None:
    run = paratrain.setup(strategy="single", log_dir=str(tmp_path), progress=False)
    with paratrain.profile(run) as p:
        records = _train(run, range(1, 4))
        assert run.timing._handles  # the gradient-ready hooks, only while profiling
    assert run.timing._handles == [] and not run.timing.enabled
    assert p.steps == 3 and len(p.ranks) == 1 and p.slow == []
    times = p.ranks[0]
    assert times.data > 0 and times.compute > 0 and times.optimizer > 0 and times.comm >= 0
    assert all(r["compute_s"] > 0 and r["per_rank"]["data_s"][0] == r["data_s"] for r in records)
    assert "compute" in str(p) and "ms per step, 3 steps" in str(p)
    run.close()
