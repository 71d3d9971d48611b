"""The architecture sweep's cells, as the workers run them: each architecture under each layout, trained by the
user's loop through paratrain's public API, with what every rank saw written to a file the moment the cell ends.

Workers run many cells per launch (start-up is paid once per launch, as the correctness matrix pays it once per
column), so one cell must not be able to take the others down: each cell has a time limit kept by a watchdog
thread, and a cell that hangs past it, raises anything but a refusal, or meets a collective timeout ends the
worker at once (`os._exit`), after writing what happened. The driver (archs_verdicts.py) reads the files, counts
that cell as failed and starts the remaining cells in a fresh launch.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import trace_cache
from matrix_cells import _Rows, full_state, placement
from torch.utils.data import DataLoader
from zoo import archs
from zoo.case import ZooCase
from zoo.reference import Optim, chunk, global_batches, to_device

import paratrain
from paratrain.errors import CollectiveTimeout


@dataclass(frozen=True)
class ArchLayout:
    """One column of the sweep: a strategy on some workers, with the options it needs beyond the defaults."""

    name: str
    strategy: str
    nproc: int
    options: dict[str, Any] = field(default_factory=dict)
    held: bool = False
    """The model inside a user's module (zoo.archs.Holder), as a training script that adds to it holds it."""
    chunks: int = 1
    """Pieces each global batch is cut into (replicas x micro-batches of a pipeline), for the reference's
    `accumulate=`: the plain loop that adds the same partial sums."""


PIPELINE = {"microbatches": 2, "balance": "equal"}
"""The library's pipeline defaults but two: 1F1B needs a micro-batch per stage (the default of 1 is refused), and
cuts pinned to equal layer counts, so a cell cannot pass or fail by where a timing put the cut."""

LAYOUTS = [
    ArchLayout("ddp", "ddp", 2),
    ArchLayout("fsdp", "fsdp", 2),
    ArchLayout("tp", "tp", 2),
    ArchLayout("tp held", "tp", 2, held=True),
    ArchLayout("fsdp+tp", "fsdp+tp", 4, {"tp_size": 2}),
    ArchLayout("pp", "pp", 2, PIPELINE, chunks=2),
    ArchLayout("ddp+pp", "ddp+pp", 4, PIPELINE, chunks=4),
    ArchLayout("auto", "auto", 2),
]
BY_NAME = {layout.name: layout for layout in LAYOUTS}
LM_LAYOUTS = ("ddp", "fsdp", "tp", "pp")
"""The layouts every causal LM transformers knows is trained under."""

SIZES = (8, 8, 4)
"""Rows of the global batches: two full ones and a short last one, as an epoch ends."""
LIMIT_S = 240.0
"""Seconds one cell may take on a worker before it counts as hung: most take under 3 s here, the slowest (Falcon-H1
under tp, its Mamba layers in plain PyTorch) 61 s."""
COLLECTIVE_S = 120.0
"""setup(timeout_s=): a collective that waits this long fails the cell as a hang rather than blocking it."""


@dataclass(frozen=True)
class ArchCell:
    arch: str
    layout: str

    @property
    def label(self) -> str:
        return f"{self.arch} / {self.layout}"


def case_for(case: ZooCase, layout: ArchLayout) -> ZooCase:
    """The case as this layout trains it: inside a Holder for the held layouts."""
    return replace(case, build=partial(archs.held, case.build)) if layout.held else case


def run_cell(case: ZooCase, layout: ArchLayout) -> dict[str, Any]:
    """The user's loop on one architecture: losses and weights after every step, and where the weights lived."""
    run = paratrain.setup(strategy=layout.strategy, seed=0, accelerator="cpu", timeout_s=COLLECTIVE_S,
                          **layout.options)
    try:
        batches = global_batches(case, 0, SIZES)
        model = case.build(0)
        optimizer = Optim().make(model.parameters(), case)
        replica, replicas = run.strategy.data_shard(run.ctx)
        example = to_device(chunk(batches[0][0], replicas)[replica], run.device)
        with trace_cache.for_case(f"arch:{case.name}:{layout.held}"):
            model, optimizer = run.prepare(model, optimizer, example=example)
        loader = run.prepare_loader(DataLoader(_Rows(batches), batch_size=run.per_worker_batch(SIZES[0])))
        losses, weights = [], []
        for inputs, targets in loader:
            inputs, targets = to_device(inputs, run.device), to_device(targets, run.device)
            losses.append(float(run.forward_backward(model, inputs, targets, case.loss_fn)))
            optimizer.step()
            optimizer.zero_grad()
            weights.append(full_state(run.unwrap(model)))
        return {"losses": losses, "weights": weights, "where": placement(run, model), "strategy": run.strategy.name}
    finally:
        run.close()


class Watchdog:
    """Ends this worker when a cell outlives its limit: a hang is one cell's failure, and the launch that
    notices the worker gone stops the others, which may be waiting for it in a collective."""

    def __init__(self, limit_s: float, on_expiry: Any) -> None:
        self.limit_s, self.on_expiry = limit_s, on_expiry
        self.deadline: float | None = None
        self.lock = threading.Condition()
        threading.Thread(target=self._watch, daemon=True).start()

    @contextmanager
    def cell(self) -> Iterator[None]:
        with self.lock:
            self.deadline = time.monotonic() + self.limit_s
            self.lock.notify()
        try:
            yield
        finally:
            with self.lock:
                self.deadline = None

    def _watch(self) -> None:
        with self.lock:
            while True:
                if self.deadline is None:
                    self.lock.wait()
                elif time.monotonic() >= self.deadline:
                    faulthandler.dump_traceback(file=sys.stderr)  # where it hung, in the launch's output
                    self.on_expiry()
                    os._exit(124)
                else:
                    self.lock.wait(self.deadline - time.monotonic())


ENDS_WORKER = ("error", "collective", "timeout")
"""Record kinds after which the worker ends itself (the launch then ends, and the next starts after the cell)."""


def record_path(folder: str | Path, index: int, rank: int) -> Path:
    return Path(folder) / f"{index}.{rank}.pt"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def run_cells(cells: list[tuple[int, ZooCase, ArchLayout]], folder: str, limit_s: float = LIMIT_S) -> None:
    """Every cell in turn on this worker; `folder/<index>.<rank>.pt` holds each cell's record, a dict with its
    `kind` ("ok" with `result`; "refused", "error", "collective" or "timeout" with `message`) and `seconds`. After
    the kinds in ENDS_WORKER the worker has exited."""
    rank = int(os.environ.get("RANK", "0"))
    current: list[int] = []

    def save(index: int, kind: str, seconds: float, **details: Any) -> None:
        path = record_path(folder, index, rank)
        torch.save({"kind": kind, "seconds": seconds, **details}, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)

    watchdog = Watchdog(limit_s, lambda: save(current[-1], "timeout", limit_s,
                                              message=f"still running after {limit_s:g} s"))
    for index, case, layout in cells:
        current.append(index)
        start = time.monotonic()
        try:
            with watchdog.cell():
                result = run_cell(case, layout)
            kind = "ok"
            save(index, kind, time.monotonic() - start, result=result)
        except CollectiveTimeout as exc:  # a refusal's type, but a hang or a lost peer: the ranks are out of step
            save(index, "collective", time.monotonic() - start, message=_first_line(exc))
            os._exit(124)
        except paratrain.ParatrainError as exc:  # raised on every rank alike: the next cell starts in step
            kind = "refused"
            save(index, kind, time.monotonic() - start, message=str(exc))
        except Exception as exc:  # noqa: BLE001 - anything else fails the cell; the other ranks may be waiting
            save(index, "error", time.monotonic() - start, message=_first_line(exc),
                 traceback=traceback.format_exc()[-4000:])
            os._exit(1)
        if rank == 0:
            print(f"archs: {case.name} / {layout.name}: {kind} ({time.monotonic() - start:.1f} s)", file=sys.stderr,
                  flush=True)
