"""Checkpoints: atomic publication, `latest`, retention, verification, fallback and what a checkpoint carries.

Tiers 1-2 (no process group or one rank); a forked child stands in for a process killed mid-save, and
one 2-rank launch writes a sharded (FSDP, torch.distributed.checkpoint) checkpoint that this process
then loads on one rank.
"""

from __future__ import annotations

import json
import os
import random
import signal
import warnings
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain import CheckpointError
from paratrain.checkpoint import manager, store


def _publish(root: Path, step: int, payload: bytes = b"x" * 100) -> Path:
    tmp = store.begin(root, step)
    (tmp / "shared.pt").write_bytes(payload)
    (tmp / "rng-0.pt").write_bytes(b"rng")
    return store.publish(root, tmp, step, {"world_size": 1, "sharded": False})


def _newest(root: Path) -> tuple[Path | None, list[str]]:
    skipped: list[str] = []
    found = store.newest_complete(root, on_skip=lambda p, e: skipped.append(f"{p.name}: {e}"))
    return (found[0] if found else None), skipped


# -- the directory protocol ---------------------------------------------------------------------------
def test_publish_names_latest_and_retention_keeps_the_last_k(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _publish(tmp_path, step)
        store.retain(tmp_path, keep=2)
    assert (tmp_path / "latest").read_text() == "step-000000004"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000000003", "step-000000004"]
    assert _newest(tmp_path) == (tmp_path / "step-000000004", [])
    meta = store.verify(tmp_path / "step-000000004")
    assert set(meta["files"]) == {"shared.pt", "rng-0.pt"} and meta["step"] == 4


def test_resaving_a_step_replaces_it_and_stale_temporaries_are_removed(tmp_path: Path) -> None:
    _publish(tmp_path, 5, b"old")
    store.begin(tmp_path, 6)  # a save that died before publishing
    _publish(tmp_path, 5, b"new!")
    store.retain(tmp_path, keep=3)
    assert (tmp_path / "step-000000005" / "shared.pt").read_bytes() == b"new!"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def _crash_at(monkeypatch: pytest.MonkeyPatch, target: str, nth: int) -> None:
    """Make the `nth` call of os.<target> during publish die like a killed process would."""
    real = getattr(os, target)
    calls = {"n": 0}

    def fake(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == nth:
            raise KeyboardInterrupt(f"killed at {target} #{nth}")
        return real(*args, **kwargs)

    monkeypatch.setattr(os, target, fake)


@pytest.mark.parametrize("target,nth", [("fsync", 1), ("fsync", 3), ("replace", 1), ("rename", 1),
                                        ("replace", 2), ("fsync", 6)])
def test_a_crash_anywhere_in_publish_leaves_latest_on_a_complete_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, nth: int) -> None:
    _publish(tmp_path, 1, b"first")
    with monkeypatch.context() as m:
        _crash_at(m, target, nth)
        with pytest.raises(KeyboardInterrupt):
            _publish(tmp_path, 2, b"second")
    named = store.latest(tmp_path)
    assert named is not None and store.verify(named)  # `latest` only ever names a complete checkpoint
    found, skipped = _newest(tmp_path)
    assert found in (tmp_path / "step-000000001", tmp_path / "step-000000002") and not skipped
    _publish(tmp_path, 3)  # the next save cleans up and moves on
    store.retain(tmp_path, keep=5)
    assert _newest(tmp_path)[0] == tmp_path / "step-000000003"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# -- verification and fallback ----------------------------------------------------------------------
@pytest.mark.parametrize("damage,message", [
    ("flip", "checksum (corrupt)"), ("truncate", "truncated"), ("delete", "is missing shared.pt"),
    ("no-meta", "never completed"),
])
def test_a_broken_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, damage: str, message: str) -> None:
    _publish(tmp_path, 1)
    newest = _publish(tmp_path, 2)
    file = newest / "shared.pt"
    if damage == "flip":
        data = bytearray(file.read_bytes())
        data[10] ^= 0xFF
        file.write_bytes(bytes(data))
    elif damage == "truncate":
        file.write_bytes(file.read_bytes()[:50])
    elif damage == "delete":
        file.unlink()
    else:
        (newest / "meta.json").unlink()
    found, skipped = _newest(tmp_path)
    assert found == tmp_path / "step-000000001"
    assert len(skipped) == 1 and skipped[0].startswith("step-000000002") and message in skipped[0]
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        store.verify(newest)


def test_latest_naming_a_removed_checkpoint_and_all_broken_and_empty(tmp_path: Path) -> None:
    assert store.newest_complete(tmp_path / "nothing-here") is None
    assert store.newest_complete(tmp_path) is None
    _publish(tmp_path, 1)
    _publish(tmp_path, 2)
    (tmp_path / "latest").write_text("step-000000009")  # names a checkpoint that is gone
    assert _newest(tmp_path) == (tmp_path / "step-000000002", [])
    for step in (1, 2):
        (tmp_path / store.checkpoint_name(step) / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="no complete checkpoint.*every one failed verification"):
        store.newest_complete(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        store.verify(tmp_path / "step-000000077")
    with pytest.raises(CheckpointError, match="is a file"):
        store.verify(tmp_path / "latest")


# -- what a checkpoint carries, through the Run API (one process) -----------------------------------
def _job(ckpt: Path, precision: str = "32") -> tuple[paratrain.Run, dict[str, Any]]:
    run = paratrain.setup(strategy="single", seed=3, checkpoint_dir=str(ckpt), precision=precision, keep_last=2)
    data = TensorDataset(torch.arange(40), torch.randn(40, 6, generator=torch.Generator().manual_seed(0)))
    loader = run.prepare_loader(DataLoader(data, batch_size=4, shuffle=True))
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return run, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "step": 0}


def _steps(run: paratrain.Run, state: dict[str, Any], n: int) -> list[list[int]]:
    seen, it = [], iter(state["loader"])
    for _ in range(n):
        idx, x = next(it)
        state["optimizer"].zero_grad()
        run.backward(state["model"](x).pow(2).mean())
        state["optimizer"].step()
        state["scheduler"].step()
        state["step"] += 1
        seen.append(idx.tolist())
    return seen


def _snapshot(run: paratrain.Run, state: dict[str, Any]) -> dict[str, Any]:
    return {"weights": {k: v.clone() for k, v in state["model"].state_dict().items()},
            "adam": [v.clone() for s in state["optimizer"].state.values() for v in s.values()],
            "lr": state["scheduler"].get_last_lr(), "loader": state["loader"].state_dict(), "step": state["step"],
            "draws": (random.random(), torch.rand(3), numpy.random.rand()), "scaler": run.scaler.get_scale()
            if run.scaler else None}


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if key == "weights":
            assert all(torch.equal(x[k], y[k]) for k in x), key
        elif key == "adam":
            assert len(x) == len(y) == 12 and all(torch.equal(u, v) for u, v in zip(x, y))
        elif key == "draws":
            assert x[0] == y[0] and torch.equal(x[1], y[1]) and x[2] == y[2]
        else:
            assert x == y, key


def test_a_checkpoint_restores_everything_the_next_steps_depend_on(tmp_path: Path) -> None:
    """Model, Adam state, LR schedule, GradScaler, all RNGs and the data position: the resumed run's next
    steps (dropout masks included) are bit-identical to the uninterrupted run's."""
    run, state = _job(tmp_path, precision="16")
    assert run.load(state) is False  # fresh start: nothing to resume
    _steps(run, state, 3)
    run.scaler.update(new_scale=1024.0)  # type: ignore[union-attr]
    run.save(state)
    after = _steps(run, state, 4)
    want = _snapshot(run, state)
    run.close()

    run2, state2 = _job(tmp_path, precision="16")
    with pytest.warns(UserWarning, match="no entry for"):
        state2["extra"] = 1  # a key the checkpoint does not have keeps its value, with a warning
        assert run2.load(state2, path=tmp_path / "step-000000003") is True
    assert state2["step"] == 3 and run2.scaler.get_scale() == 1024.0  # type: ignore[union-attr]
    assert _steps(run2, state2, 4) == after
    del state2["extra"]
    _same(_snapshot(run2, state2), want)
    run2.close()


def test_load_errors_name_the_problem_and_resume_falls_back(tmp_path: Path) -> None:
    run, state = _job(tmp_path)
    _steps(run, state, 1)
    run.save(state)
    _steps(run, state, 1)
    run.save(state)
    run.wait_for_save()  # written in the background: published before it is damaged below
    newest = tmp_path / "step-000000002"
    (newest / "shared.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="truncated"):
        run.load(state, path=newest)  # a named checkpoint is loaded or refused, never swapped
    with pytest.raises(CheckpointError, match="does not exist"):
        run.load(state, path=tmp_path / "step-000000042")
    with pytest.warns(UserWarning, match="skipping broken checkpoint step-000000002.*truncated"):
        assert run.load(state) is True
    assert state["step"] == 1
    (tmp_path / "step-000000001" / "rng-0.pt").unlink()
    with pytest.raises(CheckpointError, match="no complete checkpoint"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run.load(state)
    run.close()


def test_unnamed_saves_continue_numbering_after_a_resume(tmp_path: Path) -> None:
    run, state = _job(tmp_path)
    del state["step"]
    paths = [run.save(state).name for _ in range(2)]
    run.close()
    run2, state2 = _job(tmp_path)
    del state2["step"]
    assert run2.load(state2)
    assert paths + [run2.save(state2).name] == ["step-000000000", "step-000000001", "step-000000002"]
    run2.close()


# -- a process killed in the middle of save -----------------------------------------------------------
class _DieWhenPickled:
    def __reduce__(self) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)
        return (int, ())


class _Bomb:
    def state_dict(self) -> dict[str, Any]:
        return {"bomb": _DieWhenPickled()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    model = nn.Linear(3, 2)
    root = tmp_path / "ckpt"
    manager.save(root, 1, {"model": model, "step": 1}, rank=0, world_size=1, unwrap=lambda m: m,
                 sharded_state=False, keep=3, extra={})
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    pid = os.fork()
    if pid == 0:  # the child dies with SIGKILL while shared.pt of step 2 is being written
        try:
            with torch.no_grad():
                model.weight.add_(1.0)
            manager.save(root, 2, {"model": model, "step": 2, "bomb": _Bomb()}, rank=0, world_size=1,
                         unwrap=lambda m: m, sharded_state=False, keep=3, extra={})
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    torn = [p for p in root.iterdir() if p.name.startswith(".tmp-step-000000002")]
    assert torn and not (torn[0] / "meta.json").exists()  # the half-written save is still there ...
    assert (root / "latest").read_text() == "step-000000001"  # ... and nothing points at it
    target = manager.find(root, rank=0)
    assert target == root / "step-000000001"
    fresh = nn.Linear(3, 2)
    state: dict[str, Any] = {"model": fresh, "step": 0}
    manager.load(target, state, rank=0, world_size=1, unwrap=lambda m: m, map_location="cpu", verified=True)
    assert state["step"] == 1 and all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)


# -- sharded strategies: torch.distributed.checkpoint, resumed on another world size ----------------
def _fsdp_save(ckpt: str) -> dict[str, Any]:
    run = paratrain.setup(strategy="fsdp", seed=0, checkpoint_dir=ckpt)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(run.rank)
    for _ in range(2):
        optimizer.zero_grad()
        run.backward(model(torch.randn(4, 6, generator=g)).pow(2).mean())
        optimizer.step()
    run.save({"model": model, "optimizer": optimizer, "step": 2})
    run.wait_for_save()  # written in the background: on disk before its files are listed below
    from torch.distributed.tensor import DTensor

    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    out = {"weights": full, "files": sorted(str(p.relative_to(ckpt)) for p in Path(ckpt).rglob("*"))}
    run.close()
    return out


@pytest.mark.procs
@pytest.mark.timeout(90)
def test_sharded_checkpoint_uses_dcp_and_loads_on_another_world_size(tmp_path: Path) -> None:
    saved = paratrain.launch(_fsdp_save, str(tmp_path), nproc=2, timeout=80)
    step = "step-000000002"
    expected = {f"{step}/model/.metadata", f"{step}/rank-0.pt", f"{step}/rank-1.pt", f"{step}/rng-1.pt"}
    assert expected <= set(saved["files"])
    meta = json.loads((tmp_path / step / "meta.json").read_text())
    assert meta["layout"] == "dcp" and meta["world_size"] == 2

    run = paratrain.setup(strategy="fsdp", seed=0, checkpoint_dir=str(tmp_path))  # one rank now
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
    assert run.load(state) and state["step"] == 2
    from torch.distributed.tensor import DTensor

    got = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    assert all(torch.equal(got[k], saved["weights"][k]) for k in saved["weights"])
    moments = [s["exp_avg"] for s in optimizer.state.values()]
    assert len(moments) == 4 and all(float(m.full_tensor().abs().sum()) > 0 for m in moments)
    run.close()


def _sgd_save_and_load(ckpt: str) -> dict[str, Any]:
    """A stateless optimizer (SGD without momentum) saved and loaded under FSDP: how often torch stepped it."""
    run = paratrain.setup(strategy="fsdp", seed=0, checkpoint_dir=ckpt)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    run.backward(model(torch.randn(4, 6)).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    steps: list[int] = []
    optimizer.register_step_pre_hook(lambda *_: steps.append(1))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 1}
    run.save(state)
    before = {k: v.full_tensor() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert run.load(state)
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    out = {"steps": len(steps), "restored": all(torch.equal(before[k], after[k]) for k in before),
           "grads": [p.grad for p in model.parameters()], "lr": optimizer.param_groups[0]["lr"]}
    run.close()
    return out


@pytest.mark.procs
@pytest.mark.timeout(90)
def test_saving_and_loading_a_stateless_optimizer_takes_no_zero_step(tmp_path: Path) -> None:
    """torch's optimizer state-dict API steps an optimizer with no state on zero gradients for every parameter (a
    second copy of the rank's share); with no state to save or load, paratrain spares it."""
    got = paratrain.launch(_sgd_save_and_load, str(tmp_path), nproc=2, timeout=80)
    assert got["steps"] == 0 and got["restored"] and got["lr"] == 0.1
    assert all(g is None for g in got["grads"])


def _save_with_a_stray_optimizer_on_rank_1(ckpt: str) -> str:
    run = paratrain.setup(strategy="fsdp", seed=0, checkpoint_dir=ckpt, timeout_s=30)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    if run.rank == 1:  # this rank's optimizer belongs to no model of the state: its state cannot be gathered
        optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.01)
    try:
        run.save({"model": model, "optimizer": optimizer, "step": 1})
    except paratrain.ParatrainError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        run.close()
    return "saved"


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_a_rank_whose_state_cannot_be_gathered_fails_every_rank_before_the_collective_write(tmp_path: Path) -> None:
    """The error is every rank's, naming the rank and the cause, raised before any rank enters DCP's collectives;
    before, the healthy rank waited in DCP for the failed one until the timeout (a CollectiveTimeout)."""
    said = paratrain.launch(_save_with_a_stray_optimizer_on_rank_1, str(tmp_path), nproc=2, timeout=100,
                            all_ranks=True)
    for text in said:
        assert text.startswith("CheckpointError: rank 1:") and "belong to no model" in text, text
