"""The correctness matrix traces each zoo model once per test run, not once per cell and rank.

A pipeline cell spends most of its time in `torch.export` (2-4 s a graph, two graphs a model, on every
rank). Tracing is deterministic: the same zoo case, mode and input signature give the same graph, whatever
the layout, micro-batch count or rank. So the first trace of a key is saved (torch.export.save) in a folder
shared by the run's processes, and every later one loads it (0.5 s) or, in the same process, reuses the
ExportedProgram it already has. Each use still gets a fresh GraphModule (`ep.module()`), which paratrain
points at the new model's own parameters when it places the stages, so no state passes between cells: a
cell that trained the cached graph's tensors instead of its model's would fail its comparison.

Only the key is the harness's business (`for_case` names the zoo case around `run.prepare`); the graphs are
torch's, the splitting is paratrain's, as in any run. `preload` traces every zoo model up front: imported by the
warm template the matrix's workers fork from (`matrix_warm`), it leaves every worker with the graphs in memory.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from paratrain.parallel.pipeline import tracing

FOLDER_VARIABLE = "PARATRAIN_TEST_TRACE_CACHE"
"""The folder of saved traces, set by tests/conftest.py for one test run (workers inherit it)."""


class _Cache:
    """Which zoo case is being prepared, and the ExportedPrograms this process has (by key)."""

    def __init__(self) -> None:
        self.case: str | None = None
        self.programs: dict[str, Any] = {}
        self.hits = self.loads = self.traces = 0


CACHE = _Cache()


def _signature(value: Any) -> Any:
    """The input's structure, dtypes and every size but the batch's (traced symbolic)."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), tuple(value.shape[1:]))
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in sorted(value.items()))
    if isinstance(value, list | tuple):
        return tuple(_signature(v) for v in value)
    return repr(value)


def _key(case: str, example: Any, training: bool, model: nn.Module) -> str:
    # the parameters' shapes too: a tensor-parallel pipeline traces each rank's shards (parallel.tensor.traced)
    shapes = tuple(tuple(p.shape) for p in model.parameters())
    text = repr((case, training, torch.is_autocast_enabled("cpu"), _signature(example), shapes))  # precision later
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _program(key: str, model: nn.Module, example: Any, training: bool) -> Any:
    if key in CACHE.programs:
        CACHE.hits += 1
        return CACHE.programs[key]
    folder = os.environ.get(FOLDER_VARIABLE)
    if folder is None:
        program = _trace(model, example, training)
    else:
        path = Path(folder) / f"{key}.pt2"
        # one process traces a key while the others wait for its file (the ranks of a tensor-parallel pipeline all
        # trace the same shards; the two test processes' templates meet in the middle of the zoo)
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                CACHE.loads += 1
                with _schema_hints_cached():
                    program = torch.export.load(path)
            else:
                program = _trace(model, example, training)
                with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
                    torch.export.save(program, f)
                os.replace(f.name, path)  # whole files only: ranks of other columns may read it at any time
    CACHE.programs[key] = program
    return program


def _trace(model: nn.Module, example: Any, training: bool) -> Any:
    CACHE.traces += 1
    return tracing.exported(model, example, training)  # as the library traces (modes, no key/value cache)


class _CachedHints:
    """The `typing` module as torch's graph deserializer sees it, with `get_type_hints` remembered per class
    (and namespace: the schema module's, the same dict at every call)."""

    def __init__(self) -> None:
        self.hints: dict[tuple[Any, int], Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(typing, name)

    def get_type_hints(self, cls: Any, globalns: Any = None) -> Any:
        key = (cls, id(globalns))
        if key not in self.hints:
            self.hints[key] = typing.get_type_hints(cls, globalns=globalns)
        return self.hints[key]


_HINTS = _CachedHints()


@contextmanager
def _schema_hints_cached() -> Iterator[None]:
    """torch.export.load resolves the type hints of its schema's dataclasses again for every object it reads
    (90,000 times for the zoo's graphs, 40% of a load); the schema does not change, so they are resolved once.
    Only how fast a graph is read changes: a torch without that module attribute loads as it always did."""
    from torch._export.serde import serialize

    if getattr(serialize, "typing", None) is not typing:
        yield
        return
    serialize.typing = _HINTS  # type: ignore[assignment]
    try:
        yield
    finally:
        serialize.typing = typing  # type: ignore[assignment]


def _export(model: nn.Module, example: Any, training: bool) -> fx.GraphModule:
    if CACHE.case is None:
        return _traced(model, example, training)
    return _program(_key(CACHE.case, example, training, model), model, example, training).module()  # type: ignore[no-any-return]


_traced = tracing._export


@contextmanager
def for_case(case: str) -> Iterator[None]:
    """Traces made inside are keyed by the zoo case `case` (and reused for it)."""
    tracing._export = _export  # type: ignore[assignment]
    CACHE.case = case
    try:
        yield
    finally:
        CACHE.case = None
        tracing._export = _traced  # type: ignore[assignment]


def preload() -> None:
    """Every zoo model a pipeline traces (all but nn.Sequential ones), in both modes, into this process's cache
    (and the shared folder): the matrix's workers fork from a template that ran this."""
    import zoo
    from zoo.reference import global_batches

    names = list(zoo.MODELS)
    if int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % 2:
        names.reverse()  # two test processes preload from opposite ends and load what the other traced
    for name in names:
        case = zoo.MODELS[name]
        model = case.build(0)
        if isinstance(model, nn.Sequential):
            continue
        example = global_batches(case, 0, (8,))[0][0]
        for training in (True, False):
            try:
                _program(_key(name, example, training, model), model, example, training)
            except Exception:  # noqa: BLE001 - a model torch cannot trace: its cells see the same error themselves
                pass
