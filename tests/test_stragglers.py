"""Slow ranks named while training (observe/stragglers.py): the rule on synthetic per-rank timings, the watch's
windows and streaks driven by hand, the CUDA timing kept as events until read, and DDP runs in which one worker is
made slow on purpose (a sleep in its loader or its forward) with no observability code in the loop."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import paratrain
from paratrain.observe import stragglers
from paratrain.observe.breakdown import Breakdown
from paratrain.observe.stragglers import IN_A_ROW, RankWindow, StragglerWatch, peer_groups, slow_in_window


def _t(forward: float, synced: float = 0.0, data: float = 0.0, optimizer: float = 0.0) -> RankWindow:
    """A rank's window: `synced` holds its own backward and its waits for slower peers."""
    return RankWindow(data=data, forward=forward, synced=synced, optimizer=optimizer, wall=0.1)


# -- tier 1: the rule --------------------------------------------------------------------------------


def test_the_rank_with_more_own_work_is_named_not_the_ones_waiting_for_it() -> None:
    two = [[0, 1]]
    found = slow_in_window([_t(0.010, synced=0.032), _t(0.022, synced=0.020)], two, 0.2)
    assert list(found) == [1] and found[1].phase == "compute" and found[1].ratio == pytest.approx(2.2)
    found = slow_in_window([_t(0.010, synced=0.029), _t(0.010, synced=0.020, data=0.009)], two, 0.2)
    assert list(found) == [1] and found[1].phase == "data"  # its loader, not its forward
    three = [[0, 1, 2]]
    found = slow_in_window([_t(0.010, synced=0.026), _t(0.0105, synced=0.0255), _t(0.016, synced=0.020)],
                           three, 0.2)
    assert list(found) == [2] and found[2].peers_s == pytest.approx(0.01025)  # the median of two: their mean


def test_noise_small_excesses_and_work_nobody_waits_for_name_nobody() -> None:
    two = [[0, 1]]
    assert slow_in_window([_t(0.010, synced=0.002), _t(0.0115)], two, 0.2) == {}  # 15%: under the threshold
    assert slow_in_window([_t(0.002, synced=0.0008), _t(0.0028)], two, 0.2) == {}  # 40%, but under 1 ms
    assert slow_in_window([_t(0.010, synced=0.02), _t(0.020, synced=0.02)], two, 0.2) == {}  # nobody waits
    assert slow_in_window([_t(0.010, synced=0.010), _t(0.020)], [], 0.2) == {}  # no peers (one pipeline)
    assert slow_in_window([_t(0.010, synced=0.010), _t(0.020)], two, 1.5) == {}  # a looser threshold


def test_peers_are_the_same_position_in_every_data_parallel_replica() -> None:
    assert peer_groups([0, 1, 2]) == [[0, 1, 2]]  # ddp, fsdp: everyone
    assert peer_groups([0, 0, 1, 1]) == [[0, 2], [1, 3]]  # ddp+pp: stage 0 of each replica, stage 1 of each
    assert peer_groups([0, 0]) == []  # one pipeline: nobody to compare with


# -- tier 1: the watch, driven by hand ---------------------------------------------------------------


class _Step:
    """What the watch reads of paratrain.step.Step."""

    def __init__(self) -> None:
        self.count, self.accum = 0, 1

    @property
    def at_boundary(self) -> bool:
        return self.count % self.accum == 0


class _Peer:
    """Rank 1 of a 2-rank world, as the all-reduce returns it: its seconds per step for the window."""

    def __init__(self) -> None:
        self.times = [0.0, 0.010, 0.0, 0.0, 0.012]  # data, forward, synced, optimizer, wall
        self.calls = 0

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = flat.clone()
        out[6:12] = torch.tensor([*self.times, 1.0], dtype=torch.float64)
        return out


def _watch(monkeypatch: pytest.MonkeyPatch, replicas: int = 2) -> tuple[StragglerWatch, _Peer, list[Any]]:
    monkeypatch.setattr(stragglers, "MIN_WINDOW_S", 0.0)
    reports: list[Any] = []
    peer = _Peer()
    watch = StragglerWatch(rank=0, world_size=2, threshold=0.2, window=5, timing=Breakdown(torch.device("cpu")),
                           all_reduce_sum=peer, guard=lambda name: contextlib.nullcontext(),
                           layout=lambda: (0, replicas), beats=lambda: {1: type("Beat", (), {"host": "node7"})()},
                           report=lambda record, text: reports.append((record, text)))
    return watch, peer, reports


def _steps(watch: StragglerWatch, step: _Step, n: int, own_s: float = 0.010, wait_s: float = 0.0,
           joining: bool = False) -> None:
    for _ in range(n):
        if watch.timing.live:  # a step the watch samples: own work in its forward, the wait in its backward
            watch.timing.totals["compute"] += own_s + wait_s
            watch.timing.totals["backward"] += wait_s
        step.count += 1
        watch.after_micro_step(step, joining=joining)  # type: ignore[arg-type]


def test_a_rank_slow_in_two_windows_running_is_named_once_with_its_host(monkeypatch: pytest.MonkeyPatch) -> None:
    watch, peer, reports = _watch(monkeypatch)
    step = _Step()
    assert watch.timing.enabled and not watch.timing.profiling  # timed for the watch, not reported by run.log
    peer.times = [0.0, 0.030, 0.0, 0.0, 0.031]  # rank 1: 30 ms of compute against this rank's 10
    _steps(watch, step, 5, wait_s=0.020)  # the first window is start-up: not judged
    _steps(watch, step, 5 * (IN_A_ROW - 1), wait_s=0.020)
    assert peer.calls == IN_A_ROW and reports == []  # slow in fewer judged windows than IN_A_ROW: not yet
    _steps(watch, step, 5, wait_s=0.020)
    assert len(reports) == 1 and watch.named == [1]
    record, text = reports[0]
    last = 5 + 5 * IN_A_ROW
    assert record["rank"] == 1 and record["host"] == "node7" and record["phase"] == "compute"
    assert record["ratio"] == pytest.approx(3.0) and record["steps"] == [6, last] and record["step"] == last
    assert text.startswith("rank 1 (host node7) is slower than its peers") and "forward/backward" in text
    _steps(watch, step, 20, wait_s=0.020)
    assert len(reports) == 1 and peer.calls == IN_A_ROW + 1 + 4  # once; the windows go on


def test_a_streak_broken_by_a_normal_window_starts_again(monkeypatch: pytest.MonkeyPatch) -> None:
    watch, peer, reports = _watch(monkeypatch)
    step = _Step()
    _steps(watch, step, 5)
    for slow in ([True] * (IN_A_ROW - 1) + [False]) * 3:
        peer.times = [0.0, 0.030 if slow else 0.010, 0.0, 0.0, 0.031]
        _steps(watch, step, 5, wait_s=0.020 if slow else 0.0)
    assert reports == []


def test_accumulation_join_and_a_single_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    watch, peer, _ = _watch(monkeypatch)
    step = _Step()
    step.accum = 4
    _steps(watch, step, 19)
    assert peer.calls == 0  # 4 optimizer steps
    _steps(watch, step, 1)
    assert peer.calls == 1  # the fifth ends the window
    _steps(watch, step, 40, joining=True)
    assert peer.calls == 1  # inside run.join ranks do not step together: no collective
    _steps(watch, step, 4)  # the first step after it starts a new window
    _steps(watch, step, 16)
    assert peer.calls == 1
    _steps(watch, step, 4)
    assert peer.calls == 2
    alone, peer, _ = _watch(monkeypatch, replicas=1)
    _steps(alone, _Step(), 10)
    assert peer.calls == 0 and not alone.active and not alone.timing.enabled  # no peers: timing off for good


def test_one_step_in_four_is_timed_and_every_step_while_a_profiler_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    watch, _, _ = _watch(monkeypatch)
    step = _Step()
    live = []
    for _ in range(8):
        live.append(watch.timing.live)
        step.count += 1
        watch.after_micro_step(step, joining=False)  # type: ignore[arg-type]
    assert live == [True, False, False, False, True, True, False, False]  # windows of 5: each one's first too
    watch.timing.enable()  # paratrain.profile(run)
    for _ in range(3):
        step.count += 1
        watch.after_micro_step(step, joining=False)  # type: ignore[arg-type]
        assert watch.timing.live and watch.timing.profiling
    watch.timing.disable()
    assert watch.timing.enabled and not watch.timing.profiling


def test_off_by_setting_and_on_one_process_nothing_is_timed() -> None:
    off = StragglerWatch(rank=0, world_size=4, threshold=None, window=20, timing=Breakdown(torch.device("cpu")),
                         all_reduce_sum=lambda t: t, guard=lambda n: contextlib.nullcontext(), layout=lambda: (0, 4),
                         beats=dict, report=lambda r, t: None)
    assert not off.active and not off.timing.enabled
    run = paratrain.setup(strategy="single")
    assert not run._stragglers.active and not run.timing.enabled
    run.close()
    with pytest.raises(paratrain.ParatrainError, match="straggler_threshold must be a positive fraction"):
        paratrain.setup(straggler_threshold=0)
    with pytest.raises(paratrain.ParatrainError, match="straggler_window must be >= 1"):
        paratrain.setup(straggler_window=0)


def test_the_watch_needs_no_hook_and_a_profiler_hooks_two_parameters_whatever_the_models_size() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    timing = Breakdown(torch.device("cpu"))
    timing.track(model)
    timing.enable(watch=True)
    assert timing._handles == []  # the watch splits at run.backward instead
    with timing.micro_step():
        loss = model(torch.randn(2, 4)).sum()
        timing.backward_starts()
        loss.backward()
    data, forward, synced, optimizer, _ = timing.split()
    assert forward > 0 and synced > 0 and forward + synced == pytest.approx(timing.totals["compute"])
    with timing.phase("comm"):  # run.all_reduce: a wait, not own work
        time.sleep(0.002)
    assert timing.split()[1] == forward and timing.split()[2] >= synced + 0.002
    timing.enable()  # paratrain.profile(run)
    assert timing._hooked == [id(model[0].weight), id(model[4].bias)]  # the first and last of six parameters
    with timing.micro_step():
        model(torch.randn(2, 4)).sum().backward()
        after = time.perf_counter()
    assert timing._grad_at is not None and timing._grad_at <= after
    timing.disable()
    assert timing._handles == [] and timing.enabled and not timing.profiling
    timing.disable(watch=True)
    assert not timing.enabled


# -- tier 1: CUDA timing as events, read once ----------------------------------------------------------


class _Clock:
    now = 0.0


class _Event:
    """torch.cuda.Event on a fake device clock (this machine has no GPU)."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at: float | None = None

    def record(self) -> None:
        self.at = _Clock.now

    def elapsed_time(self, end: _Event) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1e3


def test_cuda_spans_are_events_read_at_the_snapshot_with_one_synchronisation(monkeypatch: pytest.MonkeyPatch) -> None:
    syncs: list[Any] = []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    _Clock.now = 0.0

    def loader() -> Iterator[int]:
        for batch in (1, 2):
            _Clock.now += 0.004  # 4 ms waiting for each batch
            yield batch

    timing = Breakdown(torch.device("cuda"), enabled=True)
    for _ in timing.batches(loader()):
        with timing.micro_step():
            _Clock.now += 0.004  # forward
            timing.backward_starts()
            _Clock.now += 0.006
            timing._grad_ready(torch.zeros(1))  # the last gradient, then 3 ms waiting for the buckets
            _Clock.now += 0.003
        with timing.phase("optimizer"):
            _Clock.now += 0.001
    assert syncs == [] and not any(timing.totals.values())  # nothing read (no waiting) while training
    snap = timing.snapshot()
    assert len(syncs) == 1 and snap[:4] == pytest.approx([0.008, 0.020, 0.006, 0.002])
    assert timing.split()[1:3] == pytest.approx([0.008, 0.018])  # forward; backward with its wait
    timing.snapshot()
    assert len(syncs) == 1  # nothing pending: no second synchronisation


# -- tier 3: DDP workers, one made slow on purpose ------------------------------------------------------


class _Rows(Dataset):
    """Rows of a regression; `delay` seconds of sleep per row read (a loader starved of CPU, on one rank)."""

    def __init__(self, delay: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g)
        self.delay = delay

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)
        return self.x[i], self.y[i]


class _Net(nn.Module):
    """A small MLP whose forward sleeps `delay` seconds (a slower device, on one rank)."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return self.body(x)  # type: ignore[no-any-return]


def _forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def _train(folder: str, steps: int, slow_rank: int | None, phase: str, quick_windows: bool) -> dict[str, Any]:
    """A plain DDP loop: no run.log, no profile. The test hook is the sleep on `slow_rank`, in its loader (data)
    or its forward (compute)."""
    if quick_windows:  # many short windows: the hardest case for a false positive
        stragglers.MIN_WINDOW_S = 0.0
    run = paratrain.setup(strategy="ddp", log_dir=folder, progress=False, seed=0,
                          **({"straggler_window": 10} if quick_windows else {}))
    slow = run.rank == slow_rank
    loader = run.prepare_loader(DataLoader(_Rows(0.004 if slow and phase == "data" else 0.0),
                                           batch_size=run.per_worker_batch(4 * run.world_size)))
    model = _Net(0.016 if slow and phase == "compute" else 0.0)
    model, opt = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        for _, (x, y) in zip(range(steps), _forever(loader)):
            if phase == "data":
                run.forward_backward(model, x, y, nn.functional.mse_loss)
            else:
                run.backward(nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    run.close()
    return {"err": err.getvalue(), "named": run._stragglers.named, "windows": run._stragglers.windows}


def _events(folder: Path) -> list[dict[str, Any]]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.procs
@pytest.mark.parametrize(("phase", "workers"), [("data", 2), ("compute", 3)])
def test_a_worker_made_slow_is_named_with_its_phase_and_host(tmp_path: Path, phase: str, workers: int) -> None:
    slow = workers - 1
    out = paratrain.launch(_train, str(tmp_path), 240, slow, phase, False, nproc=workers, timeout=120)
    assert out["named"] == [slow], out["err"]
    assert out["err"].count("slower than its peers") == 1
    words = {"data": "waiting for data", "compute": "forward/backward"}[phase]
    assert f"rank {slow} (host {socket.gethostname()})" in out["err"] and words in out["err"]
    [event] = _events(tmp_path)  # no run.log in the loop: the event is the file's only line
    assert event["event"] == "slow_rank" and event["rank"] == slow and event["phase"] == phase
    assert event["host"] == socket.gethostname() and event["ratio"] > 1.2 and event["step"] <= 240


@pytest.mark.procs
def test_equal_ranks_are_never_named_over_a_long_run(tmp_path: Path) -> None:
    out = paratrain.launch(_train, str(tmp_path), 200, None, "compute", True, nproc=2, timeout=120)
    assert out["windows"] == 20 and out["named"] == [] and "slower than its peers" not in out["err"]
    assert _events(tmp_path) == []
