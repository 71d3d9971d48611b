"""Checkpoints written in the background (`setup(async_save=True)`, the default): what is written is the state at
the call, `run.save` returns before the write and the next save waits for it, a rank killed mid-write leaves the
previous checkpoint `latest`, and async_save=False blocks as before.

Tier 2 (one process) for the blocking switch and a failed write; tier 3 (2 workers, ddp and fsdp) for the rest.
The write is held back by a wrapper of `paratrain.checkpoint.write` that waits for an event the training loop sets:
orderings are asserted, never durations.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import paratrain
from paratrain import CheckpointError
from paratrain import checkpoint as checkpoint_pkg
from paratrain.checkpoint import manager, store

STEP = "step-{:09d}"


def _whole(value: torch.Tensor) -> torch.Tensor:
    full = getattr(value, "full_tensor", None)  # FSDP keeps DTensor shards: collective
    return (full() if full is not None else value).detach().clone()


def _job(strategy: str, ckpt: str, **options: Any) -> tuple[paratrain.Run, dict[str, Any]]:
    run = paratrain.setup(strategy=strategy, seed=0, checkpoint_dir=ckpt, timeout_s=30, **options)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return run, {"model": model, "optimizer": optimizer, "step": 0}


def _train(run: paratrain.Run, state: dict[str, Any], steps: int) -> None:
    g = torch.Generator().manual_seed(100 * run.rank + state["step"])
    for _ in range(steps):
        state["optimizer"].zero_grad()
        run.backward(state["model"](torch.randn(4, 6, generator=g)).pow(2).mean())
        state["optimizer"].step()
        state["step"] += 1


def _snapshot(run: paratrain.Run, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    model, optimizer = run.unwrap(state["model"]), state["optimizer"]
    out = {k: _whole(v) for k, v in model.state_dict().items()}
    out.update({f"momentum.{n}": _whole(optimizer.state[p]["momentum_buffer"]) for n, p in model.named_parameters()})
    return out


def _held_writes(events: list[str], release: threading.Event) -> None:
    """Every checkpoint's write waits for `release` (set by the loop) before it starts: a slow disk, made certain."""
    real = checkpoint_pkg.write

    def held(staged: manager.Staged, **kwargs: Any) -> Path:
        assert release.wait(25), "the loop never released the write"
        path = real(staged, **kwargs)
        events.append(f"written {staged.step}")
        return path

    checkpoint_pkg.write = held  # type: ignore[assignment]


# -- tier 3: the state at the call, the ordering, an error on every rank -----------------------------------------
def _save_then_train_on(ckpt: str, strategy: str) -> dict[str, Any]:
    run, state = _job(strategy, ckpt)
    events: list[str] = []
    release = threading.Event()
    _held_writes(events, release)
    _train(run, state, 2)
    at_save = _snapshot(run, state)
    run.save(state)  # step 2: staged, then held in the background
    events.append("save 2 returned")
    published_early = (Path(ckpt) / "latest").exists()
    _train(run, state, 3)  # the weights move on while step 2 is being written

    waiting = run._writer.wait

    def released_when_waited() -> Path | None:
        events.append("save waits")
        release.set()
        return waiting()

    run._writer.wait = released_when_waited  # type: ignore[method-assign]
    run.save(state)  # step 5: waits for step 2 first
    events.append("save 5 returned")
    published_then = (Path(ckpt) / STEP.format(2) / "meta.json").exists()
    del run._writer.wait
    assert run.wait_for_save() == Path(ckpt) / STEP.format(5)
    at_end = _snapshot(run, state)

    assert run.load(state, path=Path(ckpt) / STEP.format(2)) and state["step"] == 2
    loaded = _snapshot(run, state)

    real_save = manager._torch_save
    if run.rank == 1:  # this rank's disk is full for the next checkpoint
        def full_disk(obj: Any, path: Path) -> None:
            raise OSError(28, "No space left on device")
        manager._torch_save = full_disk  # type: ignore[assignment]
    run.save(state)  # returns: the write fails in the background
    try:
        run.wait_for_save()
        error = "none"
    except CheckpointError as exc:
        error = str(exc)
    manager._torch_save = real_save  # type: ignore[assignment]
    latest_after = (Path(ckpt) / "latest").read_text()
    run.close()
    return {"events": events, "published_early": published_early, "published_then": published_then,
            "same": all(torch.equal(loaded[k], at_save[k]) for k in at_save),
            "moved": any(not torch.equal(at_end[k], at_save[k]) for k in at_save),
            "error": error, "latest_after": latest_after}


@pytest.mark.procs
@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_checkpoint_holds_the_state_at_the_call_and_the_next_save_waits(tmp_path: Path, strategy: str) -> None:
    """Saved at step 2, written only after 3 more steps: loading it gives step 2's weights and momenta bit for bit.
    `run.save` returned while its write was held; the next save waited for it (and published it) before returning.
    A write that fails on rank 1 is raised on both ranks, naming rank 1, and `latest` stays where it was."""
    got = paratrain.launch(_save_then_train_on, str(tmp_path), strategy, nproc=2, timeout=80, all_ranks=True)
    for rank, out in enumerate(got):
        events = out["events"]
        assert events[:3] == ["save 2 returned", "save waits", "written 2"], (rank, events)
        assert sorted(events[3:]) == ["save 5 returned", "written 5"], (rank, events)
        assert not out["published_early"] and out["published_then"]
        assert out["moved"] and out["same"], rank  # the weights moved on, and the checkpoint kept step 2's
        assert out["error"].startswith(f"checkpoint {STEP.format(2)} could not be written in the background"), \
            out["error"]
        assert "rank 1: OSError: [Errno 28] No space left on device" in out["error"], out["error"]
        assert out["latest_after"] == STEP.format(5)


# -- tier 3: a rank killed mid-write ------------------------------------------------------------------------------
def _killed_while_writing(ckpt: str, strategy: str) -> None:
    run, state = _job(strategy, ckpt)
    _train(run, state, 1)
    run.save(state)
    run.wait_for_save()
    at_step_1 = _snapshot(run, state)
    if run.rank == 0:
        torch.save(at_step_1, Path(ckpt) / "at-step-1.pt")
    returned = threading.Event()
    if run.rank == 1:  # dies in the background, after writing a file of step 2 and once save has returned
        real = manager._torch_save

        def die_midway(obj: Any, path: Path) -> None:
            real(obj, path)
            if returned.wait(25):
                os.kill(os.getpid(), signal.SIGKILL)

        manager._torch_save = die_midway  # type: ignore[assignment]
    _train(run, state, 1)
    run.save(state)
    returned.set()
    _train(run, state, 20)  # rank 0 finds rank 1 gone in a step's collective
    run.close()


@pytest.mark.procs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_killed_mid_write_leaves_the_previous_checkpoint_latest(tmp_path: Path, strategy: str) -> None:
    with pytest.raises(paratrain.WorkerFailed):
        paratrain.launch(_killed_while_writing, str(tmp_path), strategy, nproc=2, timeout=100)
    assert (tmp_path / "latest").read_text() == STEP.format(1)
    torn = list(tmp_path.glob(".tmp-step-000000002-*"))
    assert torn and not (torn[0] / "meta.json").exists() and any(torn[0].rglob("*.pt"))  # written in part
    assert manager.find(tmp_path, rank=0) == tmp_path / STEP.format(1)  # the torn one is not a candidate

    run, state = _job(strategy, str(tmp_path))  # one process now
    assert run.load(state) and state["step"] == 1
    want = torch.load(tmp_path / "at-step-1.pt")
    got = _snapshot(run, state)
    run.close()
    assert all(torch.equal(got[k], want[k]) for k in want)


# -- tier 2: blocking on request, a failure named at the next save -------------------------------------------------
@pytest.mark.parametrize("background", [True, False])
def test_async_save_false_writes_before_returning(tmp_path: Path, background: bool,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    run, state = _job("single", str(tmp_path), async_save=background)
    writers: list[str] = []
    real = checkpoint_pkg.write

    def recorded(staged: manager.Staged, **kwargs: Any) -> Path:
        writers.append(threading.current_thread().name)
        return real(staged, **kwargs)

    monkeypatch.setattr(checkpoint_pkg, "write", recorded)
    _train(run, state, 1)
    path = run.save(state)
    if not background:  # published before save returned, by the loop's own thread
        assert writers == ["MainThread"] and (tmp_path / "latest").read_text() == path.name
    assert run.wait_for_save() == (path if background else None)
    run.close()
    assert (tmp_path / "latest").read_text() == STEP.format(1)
    assert writers == ["paratrain-save-" + STEP.format(1) if background else "MainThread"]


def test_a_failed_background_write_is_raised_by_the_next_save_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, state = _job("single", str(tmp_path))
    _train(run, state, 1)
    run.save(state)
    run.wait_for_save()
    _train(run, state, 1)
    monkeypatch.setattr(store, "publish", lambda *a: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    run.save(state)  # returns; its publication fails in the background
    _train(run, state, 1)
    with pytest.raises(CheckpointError, match=f"checkpoint {STEP.format(2)} could not be written in the "
                                              "background: .*Input/output error"):
        run.save(state)  # raised before this one is staged
    monkeypatch.undo()
    run.save(state)
    run.close()
    assert (tmp_path / "latest").read_text() == STEP.format(3)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [STEP.format(1),
                                                                                       STEP.format(3)]


_EXITS_WITHOUT_CLOSE = """
import atexit, threading, sys
from pathlib import Path
import torch, paratrain
from paratrain import checkpoint
release = threading.Event()
real = checkpoint.write
def held(staged, **kwargs):
    assert release.wait(30)
    return real(staged, **kwargs)
checkpoint.write = held
run = paratrain.setup(strategy="single", checkpoint_dir=sys.argv[1])
model, optimizer = run.prepare(torch.nn.Linear(2, 2), torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
run.save({"model": model, "step": 7})
assert not (Path(sys.argv[1]) / "latest").exists()  # held: the write is still to come
atexit.register(release.set)  # the first exit handler (last registered): the write may go on from here
"""


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_a_process_that_exits_without_close_finishes_the_write_first(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _EXITS_WITHOUT_CLOSE, str(tmp_path)], capture_output=True,
                          text=True, timeout=50, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "latest").read_text() == STEP.format(7)
